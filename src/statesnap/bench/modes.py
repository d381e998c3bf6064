"""Checkpoint modes of the training suite: one class per way of checkpointing a training loop.

Each mode is used as real training code would use it: ``checkpoint(step)`` is called after every
optimizer step and returns the seconds it blocked the loop; ``finish()`` waits for work still in
flight. Every mode keeps the last two checkpoints on disk (older ones are deleted once a newer
one is complete), so the disk holds the same amount of data whichever mode runs.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable

import torch

KEEP_LAST = 2


class Mode:
    label = "no checkpoints"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scratch: str):
        self.model, self.optimizer, self.scratch = model, optimizer, scratch
        # (save called, checkpoint durable) per persisted checkpoint; appended by background threads
        self.done_at: list[tuple[float, float]] = []
        self._paths: list[str] = []

    def checkpoint(self, step: int) -> float:
        return 0.0

    def hook_waits(self, count: int) -> list[float]:
        """Time each checkpoint blocked the loop outside the ``checkpoint`` call (optimizer hooks)."""
        return [0.0] * count

    def background_seconds(self) -> list[float]:
        return [end - start for start, end in self.done_at]

    def finish(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def path(self, step: int) -> str:
        return os.path.join(self.scratch, f"step-{step}")

    def retire(self, path: str) -> None:
        """Record a complete checkpoint and delete the ones beyond ``KEEP_LAST``."""
        self._paths.append(path)
        while len(self._paths) > KEEP_LAST:
            old = self._paths.pop(0)
            shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.unlink(old)


class BlockingMode(Mode):
    """A save that returns when the checkpoint is durable: the whole save is stall."""

    def save(self, path: str) -> None:
        raise NotImplementedError

    def checkpoint(self, step: int) -> float:
        started = time.perf_counter()
        path = self.path(step)
        self.save(path)
        self.retire(path)
        ended = time.perf_counter()
        self.done_at.append((started, ended))
        return ended - started


class TorchSave(BlockingMode):
    label = "torch.save (+fsync)"

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            torch.save(self.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())


class DCPSave(BlockingMode):
    label = "DCP save"

    def save(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state_dict(), checkpoint_id=path, no_dist=True)


class DCPAsyncSave(Mode):
    """DCP ``async_save`` with its own CPU staging (DefaultStager), reused as torchtitan does where it can be.

    The call stages (copies) the state synchronously, then writes in a thread. Before the next
    call the loop must wait for the previous upload: DCP allows one in flight. PyTorch 2.11 and
    2.12 close a ``DefaultStager`` at the end of each staging, so it fails when reused (PyTorch
    issue 183413: ``KeyError: <class 'type'>``); there each call gets a stager of its own.
    """

    label = "DCP async_save"

    def __init__(self, *args):
        super().__init__(*args)
        self.reuse_stager = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)
        self.stager = self._new_stager()
        self.pending = None

    @staticmethod
    def _new_stager():
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                            use_async_staging=False, use_non_blocking_copy=False))

    def checkpoint(self, step: int) -> float:
        import torch.distributed.checkpoint as dcp

        started = time.perf_counter()
        self._wait_pending()
        path, called = self.path(step), time.perf_counter()
        if not self.reuse_stager:  # the last one closed itself (it has no threads to stop)
            self.stager = self._new_stager()
        future = dcp.async_save(self.state_dict(), checkpoint_id=path, async_stager=self.stager, no_dist=True)
        future.add_done_callback(lambda _: self.done_at.append((called, time.perf_counter())))
        self.pending = (future, path)
        return time.perf_counter() - started

    def _wait_pending(self) -> None:
        if self.pending is not None:
            future, path = self.pending
            future.result()
            self.retire(path)
            self.pending = None

    def finish(self) -> None:
        self._wait_pending()
        self.stager.close()


class StatesnapCheckpointer(Mode):
    """``ss.Checkpointer``: a lazy snapshot in host memory every step, persisted every ``persist_every``."""

    persist_every = 1

    def __init__(self, *args):
        super().__init__(*args)
        import statesnap as ss

        self.ckpt = ss.Checkpointer(os.path.join(self.scratch, "ckpt"), keep_last=KEEP_LAST,
                                    persist_every=self.persist_every)
        self.state = {"model": self.model, "optim": self.optimizer}

    def checkpoint(self, step: int) -> float:
        started = time.perf_counter()
        handle = self.ckpt.save(step, self.state)
        returned = time.perf_counter()
        handle.durable.add_done_callback(lambda future: self._persisted(future, started))
        return returned - started

    def _persisted(self, future, started: float) -> None:
        """Record the background time of steps that went to disk (the others resolve to None)."""
        if future.exception() is None and future.result() is not None:
            self.done_at.append((started, time.perf_counter()))

    def hook_waits(self, count: int) -> list[float]:
        waits = list(self.ckpt.stats()["hook_wait_s_per_checkpoint"])[-count:]  # the last ``count``
        return waits + [0.0] * (count - len(waits))

    def finish(self) -> None:
        self.ckpt.close()


class StatesnapPersistEvery10(StatesnapCheckpointer):
    persist_every = 10


@dataclass(frozen=True)
class ModeSpec:
    label: str
    factory: Callable[..., Mode]


MODES = {
    "none": ModeSpec(Mode.label, Mode),
    "torch_save": ModeSpec(TorchSave.label, TorchSave),
    "dcp_save": ModeSpec(DCPSave.label, DCPSave),
    "dcp_async": ModeSpec(DCPAsyncSave.label, DCPAsyncSave),
    "statesnap_p10": ModeSpec("statesnap (persist every 10)", StatesnapPersistEvery10),
    "statesnap_p1": ModeSpec("statesnap (persist every step)", StatesnapCheckpointer),
}


def make_mode(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scratch: str) -> Mode:
    return MODES[name].factory(model, optimizer, scratch)
