"""The training the chaos scenarios checkpoint, and the trainer's record of what it saved.

A trial is judged against the trainer's own word: before each ``save`` the trainer appends
``hash STEP DIGEST`` (the SHA-256 of the model and optimizer values, ``demo.worker.digest``) to
its record file and fsyncs it, so whatever kills it afterwards, the record says exactly which
values step STEP must hold. Other lines say how far the trainer got: ``ready`` (resumed, about
to train), ``staged``/``durable`` (the Checkpointer's futures resolved), ``done`` (a blocking
save returned). A line cut short by a kill is ignored.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from ...demo.worker import digest

__all__ = ["Records", "Trail", "Trainer", "build", "digest", "read_trail", "state_of", "train_step"]


def build(width: int, depth: int = 3, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small MLP with AdamW: its checkpoint holds 3 x 4 bytes per parameter."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    """One step on a batch that is a function of the step alone."""
    batch = torch.randn(8, model[0].in_features, generator=torch.Generator().manual_seed(step))
    optim.zero_grad()
    model(batch).pow(2).mean().backward()
    optim.step()


def state_of(model: nn.Module, optim: torch.optim.Optimizer, step: int = 0) -> dict:
    return {"model": model, "optim": optim, "extra": {"step": step}}


class Trainer:
    """A trial's training: each ``step`` trains, records the digest of the values it is about to
    save (in ``hashes``, and fsync'd to ``records`` if given), and saves them with
    ``save(step, state)`` (a Checkpointer's ``save``, or a blocking one), returning what it does.
    ``seed``: a trainer that resumes from a checkpoint starts from other values, so that a load
    that did nothing shows."""

    def __init__(self, save, width: int, depth: int = 3, seed: int = 0, records: "Records | None" = None,
                 hashes: dict[int, str] | None = None):
        torch.set_num_threads(1)
        self._save, self.records = save, records
        self.width, self.depth = width, depth
        self.model, self.optim = build(width, depth, seed)
        self.state = state_of(self.model, self.optim)
        self.hashes: dict[int, str] = {} if hashes is None else hashes

    def step(self, step: int):
        train_step(self.model, self.optim, step)
        self.state["extra"]["step"] = step
        self.hashes[step] = digest(self.state)
        if self.records is not None:
            self.records.add("hash", step, self.hashes[step], sync=True)
        return self._save(step, self.state)


class Records:
    """The trainer's record file: whole lines appended with one ``write`` each (``O_APPEND``),
    from the training thread and the Checkpointer's callbacks alike."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def add(self, *words, sync: bool = False) -> None:
        with self._lock:
            os.write(self._fd, (" ".join(str(w) for w in words) + "\n").encode())
            if sync:
                os.fsync(self._fd)


@dataclass
class Trail:
    """What a record file says: the digest recorded for each step (the last one wins: a resumed
    run records the steps after its checkpoint again) and how far the trainer got."""

    hashes: dict[int, str] = field(default_factory=dict)
    durable: int | None = None  # the newest step the Checkpointer reported committed
    done: int | None = None  # the newest step a blocking save returned for
    runs: int = 0  # ``ready`` lines: trainer processes that got as far as training
    # of the newest run: the last step it recorded, and the steps it saw staged
    last_hashed: int | None = None
    staged: set[int] = field(default_factory=set)


def read_trail(path: str) -> Trail:
    trail = Trail()
    try:
        with open(path) as f:
            lines = f.read().split("\n")[:-1]  # the text after the last newline was cut short
    except FileNotFoundError:
        return trail
    for line in lines:
        kind, *rest = line.split()
        if kind == "ready":
            trail.runs += 1
            trail.last_hashed = None
            trail.staged.clear()
        elif kind == "hash":
            step = int(rest[0])
            trail.hashes[step], trail.last_hashed = rest[1], step
        elif kind == "staged":
            trail.staged.add(int(rest[0]))
        elif kind == "durable":
            trail.durable = max(int(rest[0]), trail.durable or 0)
        elif kind == "done":
            trail.done = max(int(rest[0]), trail.done or 0)
    return trail
