"""The torchtitan adapter's state-dict plumbing, on real gloo ranks with FSDP2.

torchtitan 0.3.0 cannot train its Llama3 debug model on a CPU (docs/integrations.md, torchtitan,
says why), so these tests drive ``TorchtitanCheckpointer`` with stand-ins for torchtitan's
``Stateful`` containers built from torch's public ``torch.distributed.checkpoint.state_dict``
helpers, which behave as torchtitan's do: the model's state dict holds FSDP2 DTensors; the
optimizer container is a torch ``Optimizer`` that steps the AdamW it wraps and whose own state is
empty, with a flat, name-keyed state dict; the scheduler saves ``last_epoch``; the dataloader keys
its position by data-parallel rank, as bytes; the trainer saves ``step`` and ``ntokens_seen``.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

import statesnap as ss
from statesnap.integrations.torchtitan import TorchtitanCheckpointer

from dist_utils import run_ranks

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
STEPS, INTERVAL = 6, 2


class ModelParts:
    """torchtitan's ``ModelWrapper``: the model's state dict (DTensors under FSDP2)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self):
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict):
        set_model_state_dict(self.model, state_dict)


class OptimizersContainer(torch.optim.Optimizer):
    """torchtitan's container: a torch Optimizer (empty state of its own) stepping the one it holds,
    saved flat and keyed by parameter name."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)]
        torch.optim.Optimizer.__init__(self, list(model.parameters()), {})

    def step(self, closure=None):
        for optim in self.optimizers:
            optim.step()

    def zero_grad(self, set_to_none: bool = True):
        for optim in self.optimizers:
            optim.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizers, options=FLAT)

    def load_state_dict(self, state_dict):
        set_optimizer_state_dict(self.model, self.optimizers, state_dict, options=FLAT)


class LRSchedulers:
    def __init__(self, optimizers: OptimizersContainer):
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)) for o in optimizers.optimizers]

    def step(self):
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dict(self):
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state_dict):
        for scheduler in self.schedulers:
            scheduler.last_epoch = state_dict["last_epoch"]


class DataLoader:
    """Batches that depend on (rank, position); the position is saved under the rank's key."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.position = rank, world_size, 0

    def next_batch(self):
        g = torch.Generator().manual_seed(1000 * self.position + self.rank)
        self.position += 1
        return torch.randn(4, 12, generator=g), torch.randn(4, 5, generator=g)

    def state_dict(self):
        return {f"dp_rank_{self.rank}": str(self.position).encode(), "world_size": self.world_size}

    def load_state_dict(self, state_dict):
        assert state_dict["world_size"] == self.world_size
        self.position = int(state_dict[f"dp_rank_{self.rank}"].decode())


class TrainState:
    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict):
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


class Trainer:
    """A torchtitan-shaped training loop: FSDP2 on every rank of the world."""

    def __init__(self, folder: str, rank: int, world_size: int, **policy):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(12, 33), nn.Tanh(), nn.Linear(33, 7), nn.Tanh(), nn.Linear(7, 5))
        for layer in self.model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(self.model)
        self.optimizers = OptimizersContainer(self.model)
        self.lr_schedulers = LRSchedulers(self.optimizers)
        self.dataloader = DataLoader(rank, world_size)
        self.train_state = TrainState()
        states = {"model": ModelParts(self.model), "optimizer": self.optimizers, "lr_scheduler": self.lr_schedulers,
                  "dataloader": self.dataloader, "train_state": self.train_state}
        self.checkpointer = TorchtitanCheckpointer(folder, states, interval=INTERVAL, host_memory_gb=0.05,
                                                   eager_copy_mb=0,
                                                   last_save_model_only=False, **policy)

    def train_step(self) -> float:
        x, y = self.dataloader.next_batch()
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        self.checkpointer.wait_for_staging()  # where torchtitan's trainer calls maybe_wait_for_staging
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        self.train_state.step += 1
        self.train_state.ntokens_seen += y.numel()
        return loss.item()

    def train(self, until: int) -> list[float]:
        losses = []
        while self.train_state.step < until:
            losses.append(self.train_step())
            self.checkpointer.save(self.train_state.step, last_step=self.train_state.step == STEPS)
        return losses

    def full_state(self) -> dict:
        """Every parameter and optimizer value, whole (a collective on several ranks)."""
        def whole(v):  # a copy: Adam's step counts are plain tensors that later steps change in place
            return v.full_tensor() if hasattr(v, "full_tensor") else v.clone() if isinstance(v, torch.Tensor) else v
        out = {f"model.{k}": whole(v) for k, v in get_model_state_dict(self.model).items()}
        out.update({f"optimizer.{k}": whole(v) for k, v in self.optimizers.state_dict().items()})
        return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key].reshape(-1).view(torch.uint8),
                                                                b[key].reshape(-1).view(torch.uint8)), key
        else:
            assert a[key] == b[key], key


def _uninterrupted(rank, world_size, folder):
    """Train all steps, checkpointing every INTERVAL (async); keep the state at step 4."""
    trainer = Trainer(folder, rank, world_size, keep_latest_k=2, async_mode="async")
    losses = trainer.train(4)
    at_four = trainer.full_state()
    losses += trainer.train(STEPS)
    trainer.checkpointer.close()
    return losses, at_four, trainer.full_state()


def _resumed(rank, world_size, folder):
    trainer = Trainer(folder, rank, world_size, load_only=True)
    assert trainer.checkpointer.load(step=4)
    assert (trainer.train_state.step, trainer.dataloader.position) == (4, 4)
    losses = trainer.train(STEPS)
    trainer.checkpointer.close()
    return losses, trainer.full_state()


def _resharded(rank, world_size, folder):
    """One rank reads what two wrote: the dataloader's per-rank state is refused unless excluded."""
    trainer = Trainer(folder, rank, world_size)
    with pytest.raises(ss.ReshardError, match="dataloader"):
        trainer.checkpointer.load(step=4)
    trainer.checkpointer.close()
    trainer = Trainer(folder, rank, world_size, exclude_from_loading=["dataloader"])
    with pytest.raises(ss.CheckpointError, match="no committed checkpoint of step 3"):
        trainer.checkpointer.load(step=3)
    assert trainer.checkpointer.load(step=4)
    loaded = (trainer.train_state.state_dict(), trainer.lr_schedulers.state_dict(), trainer.full_state())
    # the last step saves the model alone, in the export dtype
    trainer.checkpointer.last_save_model_only, trainer.checkpointer.export_dtype = True, torch.bfloat16
    trainer.checkpointer.save(7, last_step=True)
    reader = ss.open(f"{folder}/step-7")
    exported = {k: reader.read(k) for k in reader.keys()}
    trainer.checkpointer.close()
    return loaded, exported


def test_resume_is_bit_exact_and_reshards_from_two_ranks_to_one(tmp_path):
    folder = str(tmp_path / "checkpoint")
    first = run_ranks(2, _uninterrupted, folder)
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir() if p.name.startswith("step-")) == \
        ["step-4", "step-6"]  # keep_latest_k=2
    second = run_ranks(2, _resumed, folder)
    for rank in range(2):
        losses, _, final = first[rank]
        resumed_losses, resumed_final = second[rank]
        assert resumed_losses == losses[4:]
        _same(resumed_final, final)

    (train_state, schedule, state), exported = run_ranks(1, _resharded, folder)[0]
    assert train_state == {"step": 4, "ntokens_seen": 4 * 4 * 5} and schedule == {"last_epoch": 4}
    _same(state, first[0][1])
    model = {k: v for k, v in state.items() if k.startswith("model.")}
    assert exported.keys() == model.keys()
    for key, value in model.items():
        assert torch.equal(exported[key].view(torch.int16), value.to(torch.bfloat16).view(torch.int16)), key


def test_the_optimizer_containers_step_waits_for_the_snapshot_copy(tmp_path, monkeypatch):
    """Deterministic, one process: every staging copy is held until something waits for the
    snapshot (test_guard's gate), so an unguarded step would always change the parameters before
    they are copied. The container's step must wait, and the checkpoint hold the pre-step values."""
    from test_guard import CopiesWaitForAWaiter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 9), nn.Tanh(), nn.Linear(9, 5))
    optimizers = OptimizersContainer(model)
    train_state = TrainState()
    checkpointer = TorchtitanCheckpointer(str(tmp_path / "ckpt"), {"model": ModelParts(model), "optimizer": optimizers,
                                                                   "train_state": train_state},
                                          interval=1, host_memory_gb=0.05, eager_copy_mb=0, last_save_model_only=False)
    x, y = torch.randn(4, 12), torch.randn(4, 5)
    ((model(x) - y) ** 2).mean().backward()
    optimizers.step()  # AdamW state exists from here on
    train_state.step = 1
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gate = CopiesWaitForAWaiter(monkeypatch)
    assert checkpointer.save(1)
    ((model(x) - y) ** 2).mean().backward()
    optimizers.step()  # no wait_for_staging first: only the guard stands between this and the copy
    gate.open()
    checkpointer.close()
    saved = ss.open(tmp_path / "ckpt" / "step-1")
    for name, value in before.items():
        assert torch.equal(saved.read(f"model.{name}"), value), name
    assert not torch.equal(model[0].weight, before["0.weight"])


class _Value:
    """A stateful of one tensor, as torchtitan's states are."""

    def __init__(self, value: float):
        self.t = torch.full((3,), value)

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, state):
        self.t.copy_(state["t"])


def test_a_step_directory_renamed_is_not_loaded_as_that_step(tmp_path):
    """step-5 holding what step 2 saved is damage, named, not step 5 with step 2's values."""
    model = _Value(0)
    saver = TorchtitanCheckpointer(tmp_path, {"model": model, "train_state": _Value(0)}, interval=1,
                                   async_mode="disabled", last_save_model_only=False)
    for step in (1, 2):
        model.t.fill_(step)
        saver.save(step)
    saver.close()
    (tmp_path / "step-2").rename(tmp_path / "step-5")
    fresh = _Value(0)
    loader = TorchtitanCheckpointer(tmp_path, {"model": fresh, "train_state": _Value(0)}, interval=1,
                                    async_mode="disabled", last_save_model_only=False)
    with pytest.raises(ss.CorruptCheckpointError, match="step-5 holds step 2, not step 5"):
        loader.load()
    assert loader.load(step=1) and torch.equal(fresh.t, torch.ones(3))
    loader.close()


def test_a_restart_after_a_model_only_last_save_resumes_from_the_newest_step_holding_every_state(tmp_path, caplog):
    """``last_save_model_only=True`` (the default) leaves the last step with the model alone; a run
    restarted with more steps failed in ``load(-1)`` ('missing in checkpoint ... train_state'),
    advising a strict=False it does not take. Now it resumes from the newest step that holds every
    state it loads, and says why it passed over the newer one, as torchtitan's own resume passes
    over its model-only Hugging Face exports."""
    def checkpointer(folder, model, train_state, **policy):
        return TorchtitanCheckpointer(folder, {"model": model, "train_state": train_state}, interval=2,
                                      keep_latest_k=2, async_mode="disabled", **policy)
    model, train_state = _Value(0), _Value(0)
    saver = checkpointer(tmp_path, model, train_state)
    for step in range(1, 7):
        model.t.fill_(step)
        train_state.t.fill_(step)
        saver.save(step, last_step=step == 6)
    saver.close()
    assert ss.open(tmp_path / "step-6").keys() == ["model.t"]

    model, train_state = _Value(0), _Value(0)
    loader = checkpointer(tmp_path, model, train_state)
    with caplog.at_level("WARNING", logger="statesnap"):
        assert loader.load()
    assert torch.equal(model.t, torch.full((3,), 4.0)) and torch.equal(train_state.t, torch.full((3,), 4.0))
    assert "resuming from step 4, not from the newer step 6, which holds no train_state" in caplog.text
    with pytest.raises(ss.StateMismatchError, match=r"missing in checkpoint \(1\): train_state.t") as caught:
        loader.load(step=6)  # asked for by number: refused, with advice this API can follow
    assert "exclude_from_loading" in str(caught.value) and "strict=False" not in str(caught.value)
    loader.close()

    model_only = checkpointer(tmp_path, model, train_state, exclude_from_loading=["train_state"])
    assert model_only.load() and torch.equal(model.t, torch.full((3,), 6.0))  # the model is all it loads
    model_only.close()
    shutil.rmtree(tmp_path / "step-4")  # (keep_latest_k=2 kept steps 4 and 6)
    alone = checkpointer(tmp_path, model, train_state)
    with pytest.raises(ss.CheckpointError, match="the newest, step 6, holds no train_state .* exclude_from_loading"):
        alone.load()
    alone.close()


def test_keeping_one_step_with_a_model_only_last_save_is_refused(tmp_path):
    """keep_latest_k=1: the model-only last save retired the only full checkpoint, and a longer
    run's restart found nothing to resume from (torchtitan's own manager refuses 1)."""
    states = {"model": _Value(0), "train_state": _Value(0)}
    with pytest.raises(ss.CheckpointError, match="keep_latest_k=1 with last_save_model_only=True"):
        TorchtitanCheckpointer(tmp_path, states, keep_latest_k=1)
    saver = TorchtitanCheckpointer(tmp_path, states, keep_latest_k=1, last_save_model_only=False,
                                   async_mode="disabled", interval=1)
    saver.save(1, last_step=True)
    saver.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == ["step-1"]
