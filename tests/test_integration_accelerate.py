"""``AcceleratorCheckpoints``: a real accelerate loop on the CPU (``tests/integrations/accelerate_train.py``,
with dropout, an LR scheduler and AdamW) saves every 4 steps, is SIGKILLed right after a save of
step 9 began (step 8 committed), restarts, restores from the newest committed step, and logs the same
losses and ends with the same parameters as a run never killed, bit for bit."""
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import statesnap as ss

SCRIPT = os.path.join(os.path.dirname(__file__), "integrations", "accelerate_train.py")


def _run(out, *args, killed=False):
    done = subprocess.run([sys.executable, SCRIPT, str(out), *args], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == (-9 if killed else 0), done.stderr[-3000:]


def test_killed_accelerate_loop_resumes_bit_exact(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _run(whole)
    _run(killed, "--kill-at", "8", killed=True)
    _run(killed)
    expected = json.loads((whole / "losses-0.json").read_text())
    (name,) = [n for n in os.listdir(killed) if n.startswith("losses-")]  # step 9's save may have committed
    start = int(name[len("losses-"):-len(".json")])
    assert start in (8, 9)
    resumed = json.loads((killed / name).read_text())
    assert resumed["loaded_from"] == "persistent"
    assert resumed["losses"] == {step: loss for step, loss in expected["losses"].items() if int(step) > start}
    first, second = torch.load(whole / "final.pt"), torch.load(killed / "final.pt")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert {"step-4", "step-8", "step-12"} <= set(os.listdir(killed / "ckpt"))


def test_the_gradient_scaler_is_saved_and_restored(tmp_path):
    """fp16 on a GPU gives the Accelerator a GradScaler, whose loss scale backs off at each
    overflow; ``save_state`` saves it, and so must AcceleratorCheckpoints (it did not: a resumed
    run started again from the initial scale). Here a CPU GradScaler stands in for it."""
    from accelerate import Accelerator

    from statesnap.integrations.accelerate import AcceleratorCheckpoints

    def prepared():
        accelerator = Accelerator(cpu=True)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        model = torch.nn.Linear(4, 1)
        return (accelerator, *accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1)))

    accelerator, model, optimizer = prepared()
    for _ in range(3):  # overflowing steps: 65536 -> 8192
        accelerator.backward(model(torch.full((2, 4), 1e38)).sum() * 1e38)
        optimizer.step()
        optimizer.zero_grad()
    assert accelerator.scaler.get_scale() == 8192.0
    with AcceleratorCheckpoints(accelerator, tmp_path / "ckpt") as checkpoints:
        checkpoints.save(3)
    resumed, _, _ = prepared()
    with AcceleratorCheckpoints(resumed, tmp_path / "ckpt") as checkpoints:
        assert checkpoints.load_latest() == 3
    assert resumed.scaler.get_scale() == 8192.0

    older, _, _ = prepared()  # a checkpoint saved before the scaler was: the rest is restored
    older.scaler = None
    with AcceleratorCheckpoints(older, tmp_path / "older") as checkpoints:
        checkpoints.save(5)
    older.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    with AcceleratorCheckpoints(older, tmp_path / "older") as checkpoints:
        assert checkpoints.load_latest() == 5
    assert older.scaler.get_scale() == 2.0 ** 16


def test_a_state_that_does_not_match_is_refused_with_advice_this_class_can_follow(tmp_path):
    """The mismatch error advised 'Pass strict=False', which ``load_latest`` does not take."""
    from accelerate import Accelerator

    from statesnap.integrations.accelerate import AcceleratorCheckpoints

    def prepared(outputs):
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(4, outputs)
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return accelerator

    with AcceleratorCheckpoints(prepared(1), tmp_path) as checkpoints:
        checkpoints.save(1)
    with AcceleratorCheckpoints(prepared(2), tmp_path) as checkpoints:
        with pytest.raises(ss.StateMismatchError, match=r"shape/dtype mismatch \(2\): models.0.bias") as caught:
            checkpoints.load_latest()
    assert "prepare the same models" in str(caught.value) and "strict=False" not in str(caught.value)
    assert caught.value.mismatched and not caught.value.missing


def test_rng_states_keep_the_cuda_generators_too(tmp_path, monkeypatch):
    """The per-rank RNG states that the accelerate and HF Trainer integrations save held
    Python's, numpy's and torch's CPU generators only. accelerate's ``save_state`` and the
    Trainer keep the CUDA generators too, which dropout on a GPU draws from: a run resumed from
    a statesnap checkpoint drew other dropout masks on the GPU than the run it continued. (The
    CUDA calls are stood in for, so that this runs without a GPU.)"""
    import random

    from statesnap.integrations.rng import RngStates

    generators = {0: torch.tensor([1, 2, 3], dtype=torch.uint8), 1: torch.tensor([4, 5, 6], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [generators[0].clone(), generators[1].clone()])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: generators.__setitem__(device, state.clone()))
    random.seed(0)
    ss.save({"rng": ss.PerRank(RngStates())}, tmp_path / "c")
    saved = {device: state.clone() for device, state in generators.items()}
    generators[0].fill_(9)
    generators[1].fill_(9)
    random.random()
    ss.load({"rng": ss.PerRank(RngStates())}, tmp_path / "c")
    assert all(torch.equal(generators[device], saved[device]) for device in saved)

    # a checkpoint saved without CUDA leaves the generators alone
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    ss.save({"rng": ss.PerRank(RngStates())}, tmp_path / "cpu")
    generators[0].fill_(7)
    ss.load({"rng": ss.PerRank(RngStates())}, tmp_path / "cpu")
    assert generators[0].tolist() == [7, 7, 7]


def test_a_stateful_data_loader_resumes_where_it_was_as_load_state_does(tmp_path):
    """With ``use_stateful_dataloader=True`` accelerate's ``save_state`` saves each data loader's
    position within the epoch and ``load_state`` puts it back. AcceleratorCheckpoints saved no
    position: a run resumed mid-epoch started the epoch's data again from its first batch. It
    now resumes with the batches the stock resume gives, and a checkpoint of an earlier version
    (no positions) still loads, from the epoch's start."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from statesnap.integrations.accelerate import AcceleratorCheckpoints

    def prepared(stateful=True):
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
        model = torch.nn.Linear(1, 1)
        data = torch.utils.data.DataLoader(torch.arange(40), batch_size=4, shuffle=True,
                                           generator=torch.Generator().manual_seed(3))
        _, _, data = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
        return accelerator, data

    accelerator, data = prepared()
    batches = iter(data)
    for _ in range(3):
        next(batches)
    accelerator.save_state(tmp_path / "stock")
    with AcceleratorCheckpoints(accelerator, tmp_path / "ckpt") as checkpoints:
        checkpoints.save(3)
    rest = [b.tolist() for b in batches]
    assert len(rest) == 7

    stock, stock_data = prepared()
    stock.load_state(tmp_path / "stock")
    resumed, resumed_data = prepared()
    with AcceleratorCheckpoints(resumed, tmp_path / "ckpt") as checkpoints:
        assert checkpoints.load_latest() == 3
    expected = [b.tolist() for b in stock_data]
    assert len(expected) == 7 and [b.tolist() for b in resumed_data] == expected

    older, _ = prepared(stateful=False)  # saved before positions were: no "dataloaders" in it
    with AcceleratorCheckpoints(older, tmp_path / "older") as checkpoints:
        checkpoints.save(5)
    assert "dataloaders.0._num_yielded" not in ss.open(tmp_path / "older" / "step-5").keys()
    newer, newer_data = prepared()
    with AcceleratorCheckpoints(newer, tmp_path / "older") as checkpoints:
        assert checkpoints.load_latest() == 5
    assert len(list(newer_data)) == 10


def test_a_data_loader_prepared_after_the_save_or_not_yet_leaves_the_others_positions_restored(tmp_path, caplog):
    """An evaluation loader is often prepared at the first evaluation, after a save or after the
    resume's ``load_latest``. A checkpoint holding its position failed a resume that had not
    prepared it yet (unexpected in the checkpoint), and one saved before it was prepared was
    taken for a checkpoint of an earlier version: every position was left out, then refused as
    unexpected. As with ``load_state``, each loader takes the position stored for it, one
    without starts its epoch (a warning), and a position of a loader not prepared is left unread
    (a warning)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from statesnap.integrations.accelerate import AcceleratorCheckpoints

    def accelerator():
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
        model = torch.nn.Linear(1, 1)
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return accelerator

    def loader(accelerator, size):
        data = torch.utils.data.DataLoader(torch.arange(size), batch_size=4, shuffle=True,
                                           generator=torch.Generator().manual_seed(size))
        return accelerator.prepare(data)

    first = accelerator()
    batches = iter(loader(first, 40))
    for _ in range(3):
        next(batches)
    with AcceleratorCheckpoints(first, tmp_path / "before") as checkpoints:
        checkpoints.save(3)
    evaluation = iter(loader(first, 20))
    next(evaluation)
    with AcceleratorCheckpoints(first, tmp_path / "after") as checkpoints:
        checkpoints.save(3)

    resumed = accelerator()  # the evaluation loader not prepared yet
    train = loader(resumed, 40)
    with AcceleratorCheckpoints(resumed, tmp_path / "after") as checkpoints, caplog.at_level("WARNING", "statesnap"):
        assert checkpoints.load_latest() == 3
    assert len(list(train)) == 7
    assert "position of data loader 1, which is not prepared now" in caplog.text

    caplog.clear()
    resumed = accelerator()  # both prepared, from a checkpoint saved before the second was
    train, evaluation = loader(resumed, 40), loader(resumed, 20)
    with AcceleratorCheckpoints(resumed, tmp_path / "before") as checkpoints, caplog.at_level("WARNING", "statesnap"):
        assert checkpoints.load_latest() == 3
    assert len(list(train)) == 7 and len(list(evaluation)) == 5
    assert "no position of data loader 1 " in caplog.text


class _LocalTally:
    """An object given to ``register_for_checkpointing`` whose state differs per rank (a count of
    the samples this rank has seen)."""

    def __init__(self, count=0):
        self.count = count

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def _save_a_per_rank_registered_object(rank, world, root):
    from accelerate import Accelerator

    from statesnap.integrations.accelerate import AcceleratorCheckpoints

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.register_for_checkpointing(_LocalTally(10 + rank))
    torch.manual_seed(100 + rank)  # each rank's RNG states its own
    accelerator.save_state(os.path.join(root, "stock"))
    with AcceleratorCheckpoints(accelerator, os.path.join(root, "ckpt")) as checkpoints:
        checkpoints.save(1).wait()
    return accelerator.num_processes


def test_a_registered_object_that_differs_per_rank_is_saved_as_save_state_saves_it(tmp_path):
    """``save_state`` saves the objects given to ``register_for_checkpointing`` from the main
    process and ``load_state`` gives that state to every rank, on any number of processes. A
    registered object whose state differs per rank (a local count, a rank's sampler) made
    AcceleratorCheckpoints' save fail ('replicated value(s) differ between the ranks'), with
    advice (wrap it in ss.PerRank) that a user of this class cannot follow: the training
    stopped at its first save. It is now saved from rank 0, as save_state saves it, and a
    resume on one process takes that value, as load_state does."""
    from accelerate import Accelerator

    from dist_utils import run_ranks
    from statesnap.integrations.accelerate import AcceleratorCheckpoints

    assert run_ranks(2, _save_a_per_rank_registered_object, str(tmp_path)) == [2, 2]

    def resumed():
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(2, 1)
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        tally = _LocalTally()
        accelerator.register_for_checkpointing(tally)
        return accelerator, tally

    stock, stock_tally = resumed()
    stock.load_state(str(tmp_path / "stock"))
    stock_draws = torch.rand(4)
    accelerator, tally = resumed()
    with AcceleratorCheckpoints(accelerator, tmp_path / "ckpt") as checkpoints:
        assert checkpoints.load_latest() == 1
    assert tally.count == stock_tally.count == 10
    # and rank 0 of the resumed job takes rank 0's RNG states, as load_state gives it them
    assert torch.equal(torch.rand(4), stock_draws)
    torch.manual_seed(100)  # what rank 0's generator held when it saved
    assert torch.equal(stock_draws, torch.rand(4))


def test_a_rank_the_saving_job_did_not_have_keeps_its_own_rng_states():
    """Loaded on more processes than saved (1 -> 2), rank 1 finds no RNG states of its number:
    it keeps its own, as load_state leaves it; rank 0 takes the saved ones."""
    from statesnap.integrations.accelerate import _own_rank_if_saved
    from statesnap.integrations.rng import RngStates

    torch.manual_seed(7)
    saved = [RngStates().state_dict()]
    torch.manual_seed(8)
    rng = RngStates()
    choose = _own_rank_if_saved(rng)
    rng.load_state_dict(choose(saved, 1, 2))
    kept = torch.rand(3)
    rng.load_state_dict(choose(saved, 0, 2))
    taken = torch.rand(3)
    torch.manual_seed(8)
    assert torch.equal(kept, torch.rand(3))
    torch.manual_seed(7)
    assert torch.equal(taken, torch.rand(3))


class _Locked(_LocalTally):
    def state_dict(self):
        return {**super().state_dict(), "lock": threading.Lock()}


def _save_an_object_pickle_refuses(rank, world, root):
    from accelerate import Accelerator

    from statesnap.integrations.accelerate import AcceleratorCheckpoints

    accelerator = Accelerator(cpu=True)
    accelerator.register_for_checkpointing(_Locked(rank))
    with AcceleratorCheckpoints(accelerator, root, commit_timeout_s=60) as checkpoints:
        with pytest.raises(ss.UnsafeCheckpointError, match=r"custom.0.lock: lock is not plain data"):
            checkpoints.save(1)
    return rank


def test_a_registered_value_no_save_can_store_is_named_on_every_rank(tmp_path):
    """A lock in a registered object's state: every rank says what cannot be stored."""
    from dist_utils import run_ranks

    assert run_ranks(2, _save_an_object_pickle_refuses, str(tmp_path)) == [0, 1]
