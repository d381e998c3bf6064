"""Lightning with ``StatesnapCheckpointIO``: real Trainers (one process, and DDP on 2 gloo ranks)
and ``StatesnapModelParallelStrategy`` with FSDP2 on 2) run ``tests/integrations/lightning_train.py``:
checkpoint at each epoch's end (top-2 by the loss, plus ``last``), get SIGKILLed with a save in
flight, resume with ``ckpt_path="last"``, and must then log the same losses and end with the same
parameters as a run never killed, bit for bit (one thread, fixed data, no shuffle: Lightning is
deterministic here). The FSDP2 checkpoint also resumes on one rank, the DDP one with FSDP2 on
one and two ranks, resharded."""
import collections
import enum
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from statesnap import CheckpointError
from statesnap.integrations.lightning import POINTER_FORMAT, STORE_DIR, load_from_checkpoint, read_checkpoint
from statesnap.integrations.pointers import pointer_bytes

SCRIPT = os.path.join(os.path.dirname(__file__), "integrations", "lightning_train.py")


def _run(out, *args, killed=False):
    env = {**os.environ, "PYTHONPATH": os.path.dirname(SCRIPT)}
    # its own session: the kill takes the whole process group (DDP's second rank included)
    done = subprocess.run([sys.executable, SCRIPT, str(out), *args], env=env, capture_output=True, text=True,
                          timeout=240, start_new_session=True)
    if killed:
        assert done.returncode == -9, done.stderr[-3000:]
    else:
        assert done.returncode == 0, done.stderr[-3000:]


def _losses(out, rank, resumed=False):
    with open(os.path.join(out, f"losses-{rank}{'-resumed' if resumed else ''}.json")) as f:
        return {int(k): v for k, v in json.load(f).items()}


def _assert_same_parameters(a, b, rank):
    first, second = (torch.load(os.path.join(d, f"final-{rank}.pt")) for d in (a, b))
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("mode", ["single", "ddp", "fsdp2"])
def test_killed_run_resumes_from_last_bit_exact(tmp_path, mode):
    """Killed at step 8 with that step's save in flight; resumed from whichever `last` had
    committed (step 4 or 8, both at an epoch's end): the rest of the run is the same."""
    args = {"single": [], "ddp": ["--devices", "2"], "fsdp2": ["--devices", "2", "--fsdp"]}[mode]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _run(whole, *args)
    _run(killed, *args, "--kill-at", "8", killed=True)
    resumed_from = _pointed_step(killed / "ckpt" / "last.ckpt")
    # the same checkpoint resumed with FSDP2 on another rank count (from DDP: another parallelism too),
    # resharded while it loads
    reshards = {"single": [], "ddp": ["1"], "fsdp2": ["1"]}[mode]
    for devices in reshards:
        shutil.copytree(killed, tmp_path / f"resharded-{devices}")
    _run(killed, *args, "--resume")
    for rank in range(1 if mode == "single" else 2):
        expected, resumed = _losses(whole, rank), _losses(killed, rank, resumed=True)
        assert min(resumed) in (4, 8) and max(resumed) == max(expected)
        assert resumed == {step: expected[step] for step in resumed}
        _assert_same_parameters(whole, killed, rank)
    for out in (whole, killed):
        _assert_only_kept_checkpoints_stored(out)
    for devices in reshards:
        out = tmp_path / f"resharded-{devices}"
        stored = read_checkpoint(str(out / "ckpt" / STORE_DIR / f"step-{resumed_from}"))
        _run(out, "--devices", devices, "--fsdp", "--resume")
        start = torch.load(out / "start.pt")
        moments = stored["optimizer_states"][0]["state"]
        if mode == "ddp":  # DDP numbers the moments by the parameters' order in the optimizer
            moments = {name: moments[index] for index, name in enumerate(stored["state_dict"])}
        assert set(start) == {f"param.{n}" for n in stored["state_dict"]} | {f"exp_avg.{n}" for n in moments}
        for name, value in stored["state_dict"].items():
            assert torch.equal(start[f"param.{name}"], value), name
        for name, value in moments.items():
            assert torch.equal(start[f"exp_avg.{name}"], value["exp_avg"]), name


def _pointed_step(pointer) -> int:
    return int(json.loads(pointer.read_text())["checkpoint"].rsplit("-", 1)[1])


def _assert_only_kept_checkpoints_stored(out):
    """ModelCheckpoint's top-2 and last: its deletions went through statesnap, nothing is left."""
    with open(out / "checkpoints.json") as f:
        kept = json.load(f)
    assert sorted(kept["files"]) == sorted({*kept["kth"], "last.ckpt"}) and len(kept["kth"]) == 2
    pointed = {json.loads((out / "ckpt" / name).read_text())["checkpoint"] for name in kept["files"]}
    stored = {f"{STORE_DIR}/{n}" for n in os.listdir(out / "ckpt" / STORE_DIR) if n.startswith("step-")}
    assert stored == pointed
    assert not [n for n in os.listdir(out / "ckpt") if ".tmp-" in n]


def test_statesnap_checkpoints_leave_training_as_lightnings_own_do(tmp_path):
    """The lazy snapshots change nothing in the run; the stored state is the model's own."""
    ours, theirs = tmp_path / "statesnap", tmp_path / "torch"
    _run(ours)
    _run(theirs, "--io", "torch")
    assert _losses(ours, 0) == _losses(theirs, 0)
    _assert_same_parameters(ours, theirs, 0)
    ckpt = read_checkpoint(str(ours / "ckpt" / STORE_DIR / sorted(
        os.listdir(ours / "ckpt" / STORE_DIR), key=lambda n: int(n[5:]) if n.startswith("step-") else -1)[-1]))
    final = torch.load(ours / "final-0.pt")
    assert ckpt["global_step"] == 12 and set(ckpt["state_dict"]) == set(final)
    for name, value in final.items():
        assert torch.equal(ckpt["state_dict"][name], value), name
    assert isinstance(ckpt["optimizer_states"][0]["param_groups"][0]["betas"], tuple)
    assert set(ckpt["optimizer_states"][0]["state"]) == {0, 1, 2, 3}  # integer keys, as saved

    # Lightning's way to build a model from a checkpoint file, with the pointer it named
    net = _script_module().Net
    with pytest.raises(pickle.UnpicklingError):  # torch.load cannot read a pointer: hence the function below
        net.load_from_checkpoint(ours / "ckpt" / "last.ckpt")
    model = load_from_checkpoint(net, ours / "ckpt" / "last.ckpt", map_location="cpu", width=32)
    assert model.hparams.width == 32
    assert model.state_dict().keys() == final.keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, final[name]), name
    own = load_from_checkpoint(net, theirs / "ckpt" / "last.ckpt")  # a file Lightning wrote itself
    for name, value in own.state_dict().items():
        assert torch.equal(value, final[name]), name


def _script_module():
    """The training script's module (its LightningModule), imported without its thread setting."""
    import importlib.util

    threads = torch.get_num_threads()
    spec = importlib.util.spec_from_file_location("lightning_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        torch.set_num_threads(threads)
    return module


def test_a_save_of_unchanged_tensors_shares_the_stored_step(tmp_path):
    """ModelCheckpoint saves `last.ckpt` right after the top-k file of the same step: the second
    save points at the first one's tensors and carries its own callback state in the pointer.
    Each path loads exactly what was handed to it; removing one keeps what the other names; a
    damaged own state is refused by name; a tensor changed in place makes a new step."""
    from statesnap import CheckpointError
    from statesnap.integrations.lightning import StatesnapCheckpointIO

    weight, score = torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.tensor(0.5)
    io = StatesnapCheckpointIO()

    def checkpoint(best):  # the callbacks' plain values differ between the two saves of a step
        return {"state_dict": {"w": weight}, "optimizer_states": [], "epoch": 1, "global_step": 4,
                "callbacks": {"ModelCheckpoint": {"best_model_score": score, "best_k_models": {"p": best}}}}

    topk, last = str(tmp_path / "epoch=1-step=4.ckpt"), str(tmp_path / "last.ckpt")
    io.save_checkpoint(checkpoint(0.5), topk)
    io.save_checkpoint(checkpoint(0.25), last)
    weight_then = weight.clone()
    weight.add_(1)  # an optimizer step: the next save must store the new values
    later = str(tmp_path / "epoch=2-step=8.ckpt")
    io.save_checkpoint(checkpoint(0.125), later)
    io.teardown()

    steps = sorted(n for n in os.listdir(tmp_path / STORE_DIR) if n.startswith("step-"))
    assert len(steps) == 2
    assert _pointed_step(tmp_path / "last.ckpt") == _pointed_step(tmp_path / "epoch=1-step=4.ckpt")
    io = StatesnapCheckpointIO()
    for path, best, expected in ((topk, 0.5, weight_then), (last, 0.25, weight_then), (later, 0.125, weight)):
        loaded = io.load_checkpoint(path)
        assert torch.equal(loaded["state_dict"]["w"], expected), path
        assert loaded["callbacks"]["ModelCheckpoint"]["best_k_models"] == {"p": best}, path
        assert torch.equal(loaded["callbacks"]["ModelCheckpoint"]["best_model_score"], score), path
        assert loaded["global_step"] == 4

    pointer = json.loads((tmp_path / "last.ckpt").read_text())
    pointer["own_state"] = pointer["own_state"].replace("0.25", "0.75")
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_text(json.dumps(pointer))
    with pytest.raises(CheckpointError, match="damaged.ckpt.*own state"):
        io.load_checkpoint(str(damaged))
    damaged.unlink()

    io.remove_checkpoint(topk)
    assert len([n for n in os.listdir(tmp_path / STORE_DIR) if n.startswith("step-")]) == 2
    assert torch.equal(io.load_checkpoint(last)["state_dict"]["w"], weight_then)
    io.remove_checkpoint(last)
    assert [n for n in os.listdir(tmp_path / STORE_DIR) if n.startswith("step-")] == [steps[-1]]
    io.teardown()



def test_a_ddp_optimizer_state_is_renamed_for_fsdp2_or_refused_when_it_does_not_fit():
    """DDP numbers the optimizer state by position; FSDP2's optimizer state dict names it."""
    from statesnap import CheckpointError
    from statesnap.integrations.lightning import _keyed_by_name

    live = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["a.weight", "a.bias"]}, {"params": ["b.weight"]}]}
    stored = {"state": {0: {"exp_avg": 0}, 2: {"exp_avg": 2}},
              "param_groups": [{"lr": 0.5, "params": [0, 1]}, {"params": [2]}]}
    assert _keyed_by_name(stored, live, "x") == {
        "state": {"a.weight": {"exp_avg": 0}, "b.weight": {"exp_avg": 2}},
        "param_groups": [{"lr": 0.5, "params": ["a.weight", "a.bias"]}, {"params": ["b.weight"]}]}
    assert _keyed_by_name(live, live, "x") is live  # already by name: as it is
    fewer = {"state": {}, "param_groups": [{"params": [0, 1]}]}
    with pytest.raises(CheckpointError, match="last.ckpt: its optimizer state numbers 2 parameters.* has 3"):
        _keyed_by_name(fewer, live, "last.ckpt")


def _stored_steps(directory):
    return sorted(n for n in os.listdir(directory / STORE_DIR) if n.startswith("step-"))


def test_saves_with_an_optimizer_step_or_an_inference_tensor_between_are_never_shared(tmp_path):
    """An optimizer may write through ``.data`` (no version counter sees that) and an inference
    tensor has no version counter: the second save stores its own tensors, which load as handed."""
    from statesnap.integrations.lightning import StatesnapCheckpointIO

    class WritesThroughData(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(1)

    weight = torch.zeros(4)
    optimizer = WritesThroughData([weight])
    io = StatesnapCheckpointIO()
    checkpoint = {"state_dict": {"w": weight}, "optimizer_states": [], "epoch": 0, "global_step": 2}
    io.save_checkpoint(checkpoint, str(tmp_path / "a.ckpt"))
    optimizer.step()
    io.save_checkpoint(checkpoint, str(tmp_path / "b.ckpt"))
    with torch.inference_mode():
        frozen = torch.zeros(2)
    io.save_checkpoint({**checkpoint, "ema": frozen}, str(tmp_path / "c.ckpt"))
    with torch.inference_mode():
        frozen.add_(5)
    io.save_checkpoint({**checkpoint, "ema": frozen}, str(tmp_path / "d.ckpt"))
    io.teardown()
    assert len(_stored_steps(tmp_path)) == 4
    io = StatesnapCheckpointIO()
    assert torch.equal(io.load_checkpoint(str(tmp_path / "a.ckpt"))["state_dict"]["w"], torch.zeros(4))
    assert torch.equal(io.load_checkpoint(str(tmp_path / "b.ckpt"))["state_dict"]["w"], torch.ones(4))
    assert torch.equal(io.load_checkpoint(str(tmp_path / "d.ckpt"))["ema"], torch.full((2,), 5.0))


def test_a_save_after_ss_load_into_the_module_stores_the_loaded_values(tmp_path):
    """ss.load writes a module's parameters in place: the next save must see them changed and
    store them, not point at the step saved before the load."""
    import statesnap as ss
    from statesnap.integrations.lightning import StatesnapCheckpointIO

    model, best = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    with torch.no_grad():
        best.weight.fill_(7.0)
        best.bias.fill_(7.0)
    ss.save({"model": best}, tmp_path / "best")
    io = StatesnapCheckpointIO()

    def checkpoint():
        return {"state_dict": model.state_dict(), "optimizer_states": [], "epoch": 0, "global_step": 2}
    io.save_checkpoint(checkpoint(), str(tmp_path / "a.ckpt"))
    ss.load({"model": model}, tmp_path / "best")
    io.save_checkpoint(checkpoint(), str(tmp_path / "b.ckpt"))
    io.teardown()
    assert len(_stored_steps(tmp_path)) == 2
    loaded = StatesnapCheckpointIO().load_checkpoint(str(tmp_path / "b.ckpt"))["state_dict"]
    assert torch.equal(loaded["weight"], torch.full((1, 4), 7.0)) and torch.equal(loaded["bias"], torch.full((1,), 7.0))


def test_a_pointer_that_cannot_be_written_is_raised_and_the_others_are_written(tmp_path, monkeypatch):
    import statesnap.integrations.lightning as lightning_io
    from statesnap import CheckpointError

    written = lightning_io.write_atomically

    def failing(fs, path, data, durable=True, exclusive=False):
        if path.endswith("top.ckpt"):
            raise OSError(28, "No space left on device")
        written(fs, path, data, durable, exclusive)
    monkeypatch.setattr(lightning_io, "write_atomically", failing)
    weight = torch.arange(4.0)
    io = lightning_io.StatesnapCheckpointIO()
    checkpoint = {"state_dict": {"w": weight}, "optimizer_states": [], "epoch": 0, "global_step": 2}
    io.save_checkpoint(checkpoint, str(tmp_path / "top.ckpt"))
    io.save_checkpoint({**checkpoint, "callbacks": {"k": 1}}, str(tmp_path / "last.ckpt"))  # shares the step
    with pytest.raises(CheckpointError, match="top.ckpt could not be pointed at step 1.*No space left.*free space there"):
        io.teardown()
    assert not (tmp_path / "top.ckpt").exists()
    loaded = lightning_io.StatesnapCheckpointIO().load_checkpoint(str(tmp_path / "last.ckpt"))
    assert torch.equal(loaded["state_dict"]["w"], weight) and loaded["callbacks"] == {"k": 1}


@pytest.mark.parametrize("commits", [True, False])
def test_a_removal_waits_for_the_save_in_flight(tmp_path, monkeypatch, commits):
    """With ``save_top_k=1`` Lightning removes the one good checkpoint right after it starts
    saving the next: the removal happens once that save commits, and never if it fails (a crash
    or a full disk then still leaves a checkpoint to resume from)."""
    import threading

    from statesnap import CheckpointError
    from statesnap.integrations.lightning import StatesnapCheckpointIO
    from statesnap.storage.local import LocalBackend

    io = StatesnapCheckpointIO()
    old, new = str(tmp_path / "epoch=0-step=4.ckpt"), str(tmp_path / "epoch=1-step=8.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.zeros(4)}, "global_step": 4}, old)
    io.load_checkpoint(old)  # committed
    release, commit = threading.Event(), LocalBackend.commit

    def held_commit(self, staging, final, *args, **kwargs):
        assert release.wait(60)
        if not commits:
            raise OSError(28, "No space left on device")
        return commit(self, staging, final, *args, **kwargs)
    monkeypatch.setattr(LocalBackend, "commit", held_commit)
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "global_step": 8}, new)
    io.remove_checkpoint(old)  # as ModelCheckpoint does, the new save still in flight
    assert os.path.exists(old) and len(_stored_steps(tmp_path)) == 1
    release.set()
    if commits:
        io.teardown()
        assert not os.path.exists(old) and len(_stored_steps(tmp_path)) == 1
        assert torch.equal(StatesnapCheckpointIO().load_checkpoint(new)["state_dict"]["w"], torch.ones(4))
    else:
        with pytest.raises(CheckpointError, match="No space left"):
            io.teardown()
        assert not os.path.exists(new)
        assert torch.equal(StatesnapCheckpointIO().load_checkpoint(old)["state_dict"]["w"], torch.zeros(4))


def test_after_a_failed_save_removals_are_not_held_and_other_loads_read_what_is_there(tmp_path, monkeypatch):
    """A save that failed is in flight no more: a removal after a later commit is done at once,
    and another plugin's load of the failed save's path reads the step the file still names (the
    failure is the saving plugin's to raise)."""
    from statesnap.integrations.lightning import StatesnapCheckpointIO
    from statesnap.storage.local import LocalBackend

    commit, failing = LocalBackend.commit, [False]

    def commit_or_fail(self, *args, **kwargs):
        if failing[0]:
            failing[0] = False
            raise OSError(28, "No space left on device")
        return commit(self, *args, **kwargs)
    monkeypatch.setattr(LocalBackend, "commit", commit_or_fail)
    io = StatesnapCheckpointIO(on_error="warn")
    first, last, third = (str(tmp_path / name) for name in ("epoch=0.ckpt", "last.ckpt", "epoch=2.ckpt"))
    io.save_checkpoint({"state_dict": {"w": torch.zeros(4)}, "global_step": 4}, first)
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "global_step": 6}, last)
    io.load_checkpoint(last)
    failing[0] = True
    io.save_checkpoint({"state_dict": {"w": torch.full((4,), 2.0)}, "global_step": 8}, last)
    assert StatesnapCheckpointIO().load_checkpoint(last)["global_step"] == 6
    io.save_checkpoint({"state_dict": {"w": torch.full((4,), 3.0)}, "global_step": 10}, third)
    io.load_checkpoint(third)
    io.remove_checkpoint(first)  # nothing in flight: at once
    assert not os.path.exists(first) and len(_stored_steps(tmp_path)) == 2
    io.teardown()


def test_a_misspelled_setting_is_refused_when_the_plugin_is_made():
    from statesnap import CheckpointError
    from statesnap.integrations.lightning import StatesnapCheckpointIO

    with pytest.raises(CheckpointError, match="no setting 'host_memroy_gb' \\(did you mean 'host_memory_gb'"):
        StatesnapCheckpointIO(host_memroy_gb=4)


def test_a_checkpoint_saved_by_hand_loads_at_once_elsewhere_in_the_process(tmp_path):
    """``trainer.save_checkpoint(path)`` returns before the pointer is written (at the commit):
    a load of ``path`` by another plugin (a new Trainer) or ``load_from_checkpoint`` waits for it."""
    from statesnap.integrations.lightning import StatesnapCheckpointIO

    saver = StatesnapCheckpointIO()
    path = str(tmp_path / "manual.ckpt")
    saver.save_checkpoint({"state_dict": {"w": torch.arange(1 << 18, dtype=torch.float32)}, "global_step": 3}, path)
    loaded = StatesnapCheckpointIO().load_checkpoint(path)
    assert loaded["global_step"] == 3 and torch.equal(loaded["state_dict"]["w"], torch.arange(1 << 18,
                                                                                         dtype=torch.float32))
    saver.teardown()


def test_a_damaged_pointer_keeps_its_step_and_does_not_stop_later_saves(tmp_path):
    from statesnap import CheckpointError
    from statesnap.integrations.lightning import StatesnapCheckpointIO

    weight = torch.arange(4.0)
    io = StatesnapCheckpointIO()
    checkpoint = {"state_dict": {"w": weight}, "optimizer_states": [], "epoch": 0, "global_step": 2}
    io.save_checkpoint(checkpoint, str(tmp_path / "top.ckpt"))
    io.save_checkpoint({**checkpoint, "callbacks": {"k": 1}}, str(tmp_path / "last.ckpt"))
    io.teardown()
    pointer = json.loads((tmp_path / "last.ckpt").read_text())
    pointer["own_state"] = pointer["own_state"].replace("1", "7")
    (tmp_path / "last.ckpt").write_text(json.dumps(pointer))
    (tmp_path / "top.ckpt").unlink()  # the step is now named only by the damaged pointer

    io = StatesnapCheckpointIO()
    io.save_checkpoint({**checkpoint, "global_step": 3}, str(tmp_path / "next.ckpt"))
    io.teardown()
    assert len(_stored_steps(tmp_path)) == 2  # the damaged pointer's step was not taken for an orphan
    with pytest.raises(CheckpointError, match="last.ckpt.*own state is damaged"):
        io.load_checkpoint(str(tmp_path / "last.ckpt"))
    assert torch.equal(io.load_checkpoint(str(tmp_path / "next.ckpt"))["state_dict"]["w"], weight)


@pytest.mark.parametrize("damage", ["not json", "malformed target"])
def test_a_pointer_damaged_beyond_reading_keeps_every_unnamed_step(tmp_path, damage, caplog):
    """Opening a store drops committed steps no pointer names (a crash before the pointer was
    written), unless a pointer cannot be read: the step it named must not be taken for one."""
    from statesnap.integrations.lightning import StatesnapCheckpointIO

    weight = torch.arange(4.0)
    io = StatesnapCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": weight}, "optimizer_states": [], "global_step": 1},
                       str(tmp_path / "last.ckpt"))
    io.teardown()
    text = (tmp_path / "last.ckpt").read_text()
    (tmp_path / "last.ckpt").write_text(text[:-7] if damage == "not json" else
                                        text.replace("statesnap/step-1", "../elsewhere/step-1"))
    io = StatesnapCheckpointIO()
    with caplog.at_level("WARNING", logger="statesnap"):
        io.save_checkpoint({"state_dict": {"w": weight}, "optimizer_states": [], "global_step": 2},
                           str(tmp_path / "next.ckpt"))
    io.teardown()
    assert _stored_steps(tmp_path) == ["step-1", "step-2"]
    assert "last.ckpt cannot be read as pointers" in caplog.text


@pytest.mark.parametrize("content", [b'{"format": "statesnap-lightning-1", "checkpoint": "stat', b"", b"\x13garbage",
                                     b'{"format":' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_loading_a_damaged_pointer_names_it(tmp_path, content):
    """A pointer cut short, emptied or overwritten is reported as a damaged pointer, not handed to
    torch.load (whose error would suggest weights_only=False); Lightning's own files still load.
    JSON nested 100,000 deep is one too (it raised a RecursionError)."""
    from statesnap import CheckpointError
    from statesnap.integrations.lightning import StatesnapCheckpointIO

    (tmp_path / "last.ckpt").write_bytes(content)
    with pytest.raises(CheckpointError, match="last.ckpt is neither a statesnap pointer nor a Lightning checkpoint"):
        StatesnapCheckpointIO().load_checkpoint(str(tmp_path / "last.ckpt"))
    torch.save({"state_dict": {"w": torch.ones(2)}}, tmp_path / "own.ckpt")
    assert torch.equal(StatesnapCheckpointIO().load_checkpoint(str(tmp_path / "own.ckpt"))["state_dict"]["w"],
                       torch.ones(2))


def test_a_pointer_whose_step_was_deleted_never_names_a_later_save(tmp_path):
    from statesnap import CheckpointError
    from statesnap.integrations.lightning import StatesnapCheckpointIO

    io = StatesnapCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "optimizer_states": [], "global_step": 8},
                       str(tmp_path / "last.ckpt"))
    io.teardown()
    shutil.rmtree(tmp_path / STORE_DIR / _stored_steps(tmp_path)[0])  # space cleared by hand
    io = StatesnapCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "optimizer_states": [], "global_step": 4},
                       str(tmp_path / "last-v1.ckpt"))
    io.teardown()
    with pytest.raises(CheckpointError):
        io.load_checkpoint(str(tmp_path / "last.ckpt"))
    assert torch.equal(io.load_checkpoint(str(tmp_path / "last-v1.ckpt"))["state_dict"]["w"], torch.ones(2))


def test_a_save_with_no_teardown_to_come_is_finished_when_the_program_ends(tmp_path):
    """``trainer.save_checkpoint`` after ``fit`` (Lightning has torn the plugin down already):
    the program used to end with the save's daemon threads, the checkpoint never committed and
    nothing said. Now the save is finished at exit. The path is a ``file://`` URL, which the
    plugin used to write under ``<cwd>/file:``."""
    code = f"""
import torch
from statesnap.integrations.lightning import StatesnapCheckpointIO
io = StatesnapCheckpointIO(host_memory_gb=0.05)
io.save_checkpoint({{"state_dict": {{"w": torch.arange(1 << 16, dtype=torch.float32)}}, "epoch": 0,
                    "global_step": 7}}, "file://{tmp_path}/manual.ckpt")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not os.path.exists(tmp_path / "file:")
    from statesnap.integrations.lightning import StatesnapCheckpointIO

    loaded = StatesnapCheckpointIO().load_checkpoint(tmp_path / "manual.ckpt")
    assert loaded["global_step"] == 7 and torch.equal(loaded["state_dict"]["w"], torch.arange(1 << 16, dtype=torch.float32))


class _Mode(str, enum.Enum):
    A = "a"


class _Level(enum.IntEnum):
    LOW = 1


class _Pair(collections.namedtuple("_Pair", "first second")):
    pass


@pytest.mark.parametrize("value", [collections.defaultdict(int, {"x": 1}), _Level.LOW, _Mode.A, _Pair(1, 2),
                                   _Pair(torch.ones(2), 2), [[1], {"k": _Level.LOW}],
                                   {_Level.LOW: 1}, bytearray(b"ab")], ids=repr)
def test_values_that_plain_data_would_give_back_as_another_type_are_pickled_or_refused(tmp_path, value):
    """A ``defaultdict``, an enum on ``int`` or ``str`` or a namedtuple in the checkpoint (a
    callback's state, a hyper-parameter) were stored as their base type and loaded as a dict, an
    int, a str, a tuple: a resumed run then met a KeyError or an
    AttributeError, or compared otherwise, where Lightning's own resume gives them back. They are
    not plain data: refused by name, or, with ``allow_pickle=True``, given back as themselves."""
    from statesnap import CheckpointError
    from statesnap.integrations.lightning import StatesnapCheckpointIO

    checkpoint = {"state_dict": {"w": torch.zeros(2)}, "callbacks": {"Counts": {"seen": value}}}
    io = StatesnapCheckpointIO()
    with pytest.raises(CheckpointError, match=r"callbacks\.Counts\.seen.*not plain data.*allow_pickle=True"):
        io.save_checkpoint(checkpoint, str(tmp_path / "refused.ckpt"))
    io.teardown()
    io = StatesnapCheckpointIO(allow_pickle=True)
    io.save_checkpoint(checkpoint, str(tmp_path / "kept.ckpt"))
    io.teardown()
    back = StatesnapCheckpointIO(allow_pickle=True).load_checkpoint(str(tmp_path / "kept.ckpt"))
    seen = back["callbacks"]["Counts"]["seen"]
    assert type(seen) is type(value) and repr(seen) == repr(value)


def test_dicts_a_reader_takes_as_dicts_stay_plain_data(tmp_path):
    """A state dict (``OrderedDict``) and ``MultiStepLR``'s milestones (a ``Counter``) are plain
    data: stored without pickle; the state dict loaded as a dict of the same items, which its
    readers take, the milestones as a Counter (a MultiStepLR stepped with an explicit epoch calls
    ``milestones.elements()``, which a dict lacks)."""
    from statesnap.integrations.lightning import StatesnapCheckpointIO

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[1, 3, 3])
    ordered = collections.OrderedDict(w=torch.ones(2))
    io = StatesnapCheckpointIO()
    io.save_checkpoint({"state_dict": ordered, "lr_schedulers": [scheduler.state_dict()]}, str(tmp_path / "a.ckpt"))
    io.teardown()
    back = StatesnapCheckpointIO().load_checkpoint(str(tmp_path / "a.ckpt"))
    assert back["lr_schedulers"][0]["milestones"] == {1: 1, 3: 2} and torch.equal(back["state_dict"]["w"], ordered["w"])
    resumed = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[5])
    resumed.load_state_dict(back["lr_schedulers"][0])
    lrs = []
    for _ in range(4):
        optimizer.step()
        resumed.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.1, 0.1, 0.001, 0.001])
    assert type(back["lr_schedulers"][0]["milestones"]) is collections.Counter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (PyTorch deprecates the epoch argument)
        resumed.step(epoch=2)  # the closed form: one milestone (1) passed
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


def test_a_numpy_float_is_stored_as_the_float_it_is(tmp_path):
    """numpy's float64 is a float: an lr drawn with numpy (a sweep) stays one through the LR
    schedulers. It is stored without pickle and comes back as a Python float of the same value,
    whose arithmetic is the same."""
    from statesnap.integrations.lightning import StatesnapCheckpointIO

    lr = np.float64(0.1) * 3
    io = StatesnapCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "optimizer_states": [{"param_groups": [{"lr": lr}]}]},
                       str(tmp_path / "a.ckpt"))
    io.teardown()
    back = StatesnapCheckpointIO().load_checkpoint(str(tmp_path / "a.ckpt"))["optimizer_states"][0]["param_groups"][0]
    assert type(back["lr"]) is float and back["lr"] == lr and back["lr"] * 0.5 == lr * 0.5


def test_a_torch_size_is_stored_as_the_tuple_it_is(tmp_path):
    """A ``torch.Size`` (a shape among the hyper-parameters: ``save_hyperparameters`` of a model
    given ``shape=x.shape``) is a tuple of ints. Refused as a tuple subclass, it failed the run's
    first save, where it had been stored; it is stored without pickle and comes back as a tuple
    equal to it."""
    from statesnap.integrations.lightning import StatesnapCheckpointIO

    shape = torch.Size([2, 3])
    io = StatesnapCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "hyper_parameters": {"shape": shape, "shapes": [shape]}},
                       str(tmp_path / "a.ckpt"))
    io.teardown()
    back = StatesnapCheckpointIO().load_checkpoint(str(tmp_path / "a.ckpt"))["hyper_parameters"]
    assert back == {"shape": (2, 3), "shapes": [(2, 3)]} and torch.zeros(back["shape"]).shape == shape


def test_stochastic_weight_averaging_waits_for_the_checkpoint_in_flight(tmp_path):
    """StochasticWeightAveraging copies the averaged weights into the model when averaging ends,
    outside any optimizer step, while the last epoch's checkpoint could still be copying them:
    ``fit`` failed with a ConsistencyError (changed in place after save()). Its copy now waits
    for the copies in flight, and every checkpoint holds what Lightning's own saves hold."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from statesnap.integrations.lightning import StatesnapCheckpointIO

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, index):
            return self.layer(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(io, out):
        torch.manual_seed(0)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=8)
        trainer = pl.Trainer(max_epochs=4, default_root_dir=out, plugins=[io], enable_progress_bar=False, logger=False,
                             enable_model_summary=False, callbacks=[
                                 StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2),
                                 ModelCheckpoint(dirpath=out, every_n_epochs=1, save_top_k=-1)])
        trainer.fit(Net(), data)
        assert trainer.strategy.checkpoint_io is io  # (where the docs say to find wait_staged)
        return sorted(n for n in os.listdir(out) if n.endswith(".ckpt"))

    names = fit(StatesnapCheckpointIO(), tmp_path / "ours")
    assert names == fit(TorchCheckpointIO(), tmp_path / "theirs") and len(names) == 4
    for name in names:
        ours = StatesnapCheckpointIO().load_checkpoint(str(tmp_path / "ours" / name))
        theirs = torch.load(tmp_path / "theirs" / name, weights_only=False)
        for key, value in theirs["state_dict"].items():
            assert torch.equal(ours["state_dict"][key], value), (name, key)


def test_a_name_whose_save_is_in_flight_is_taken_as_lightnings_own_files_are(tmp_path, monkeypatch):
    """ModelCheckpoint picks a name by whether a file is there (``epoch=0.ckpt``, then
    ``epoch=0-v1.ckpt``...). The pointer was written only at the commit, so a name still in flight
    looked free: the next save took it and replaced the first (5 of 8 checkpoints lost, top-k scores
    kept for steps no file held). Each name is now taken when its save starts, as Lightning's own
    files are, and a name that exists keeps naming its committed step until the commit."""
    import time

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from statesnap.integrations.lightning import StatesnapCheckpointIO
    from statesnap.storage.local import LocalBackend

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, index):
            loss = self.layer(batch[0]).square().mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(io, out):
        torch.manual_seed(0)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 8)), batch_size=8)
        callback = ModelCheckpoint(dirpath=out, filename="{epoch}", every_n_train_steps=1, monitor="loss",
                                   save_top_k=-1)
        pl.Trainer(max_epochs=1, plugins=[io], enable_progress_bar=False, logger=False, enable_model_summary=False,
                   callbacks=[callback]).fit(Net(), data)
        return {os.path.basename(path): float(score) for path, score in callback.best_k_models.items()}

    commit = LocalBackend.commit

    def slow_commit(self, *args, **kwargs):  # every save still in flight when the next name is picked
        time.sleep(0.3)
        return commit(self, *args, **kwargs)
    monkeypatch.setattr(LocalBackend, "commit", slow_commit)
    ours, theirs = fit(StatesnapCheckpointIO(), tmp_path / "ours"), fit(TorchCheckpointIO(), tmp_path / "theirs")
    assert ours == theirs and len(ours) == 6
    for name in ours:
        step = StatesnapCheckpointIO().load_checkpoint(str(tmp_path / "ours" / name))["global_step"]
        assert step == torch.load(tmp_path / "theirs" / name, weights_only=False)["global_step"], name

    # an existing name is not taken over before the commit; a name left taken by a crash is said to be
    io, last = StatesnapCheckpointIO(), str(tmp_path / "last.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "global_step": 1}, last)
    io.load_checkpoint(last)
    before = open(last, "rb").read()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 2}, last)
    assert open(last, "rb").read() == before
    # what ckpt_path="last" chooses among is never taken early: a run killed while saving it resumes from another
    on_exception = str(tmp_path / "on_exception.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, on_exception)
    assert not os.path.exists(on_exception)
    io.teardown()
    assert StatesnapCheckpointIO().load_checkpoint(on_exception)["global_step"] == 3
    assert StatesnapCheckpointIO().load_checkpoint(last)["global_step"] == 2
    with open(last, "wb") as f:
        f.write(pointer_bytes(POINTER_FORMAT, f"{STORE_DIR}/step-99"))
    with pytest.raises(CheckpointError, match="step-99 is not there: the job stopped while saving it"):
        StatesnapCheckpointIO().load_checkpoint(last)
