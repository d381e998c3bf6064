"""Blocking only on overwrite: optimizer pre-step hooks and version-counter checks.

Forward and backward only read parameters and optimizer state, so the snapshot copies run while
they do. The first thing that writes is the optimizer step: a pre-step hook on each optimizer in
the state waits until the tensors *that* optimizer changes (its parameters and its state) are
copied, and no longer. Anything else that changes a tensor in place before its copy finished is
caught by the tensor's version counter, and that checkpoint fails instead of mixing two steps.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Iterable

import torch

from ..errors import ConsistencyError
from ..monitor.events import now
from ..state.placement import is_dtensor


class Countdown:
    """Outstanding work that someone waits for. Starts at one (the "still adding work" token),
    so it cannot reach zero before all work has been added; ``release`` opens it on failure."""

    def __init__(self, on_zero: Callable[[], None] | None = None):
        self._count = 1
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._on_zero = on_zero

    def add(self) -> None:
        with self._lock:
            self._count += 1

    def finish(self) -> None:
        with self._lock:
            self._count -= 1
            reached = self._count == 0
        if reached:
            if self._on_zero is not None:
                self._on_zero()
            self._done.set()

    def release(self) -> None:
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


def _storage_ptr(t: torch.Tensor) -> int:
    if is_dtensor(t):
        t = t.to_local()
    return t.untyped_storage().data_ptr()


def optimizer_storages(optim: torch.optim.Optimizer) -> set[int]:
    """Storages the next ``optim.step()`` writes: its parameters and its per-parameter state."""
    ptrs = set()
    for group in optim.param_groups:
        for p in group["params"]:
            ptrs.add(_storage_ptr(p))
            for value in optim.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    ptrs.add(_storage_ptr(value))
    return ptrs


def find_optimizers(state) -> list[torch.optim.Optimizer]:
    found = []
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.optim.Optimizer):
            found.append(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
    return found


def owners_of(tensors: Iterable[torch.Tensor], optimizers: list[torch.optim.Optimizer]) -> list[int | None]:
    """For each tensor, the id of the optimizer whose step changes it (None: no optimizer does)."""
    owner_by_ptr = {}
    for optim in optimizers:
        for ptr in optimizer_storages(optim):
            owner_by_ptr.setdefault(ptr, id(optim))
    return [owner_by_ptr.get(_storage_ptr(t)) for t in tensors]


def version_of(t: torch.Tensor) -> int | None:
    """The in-place version counter, or None for tensors without one (inference mode)."""
    try:
        return (t.to_local() if is_dtensor(t) else t)._version
    except RuntimeError:
        return None


def check_unchanged(t: torch.Tensor, expected: int | None, fqn: str, step: int) -> None:
    if expected is not None and version_of(t) != expected:
        raise ConsistencyError(
            f"checkpoint of step {step}: tensor {fqn!r} was changed in place after save() and before its "
            "snapshot copy finished, so this checkpoint would mix two steps and was dropped. Change "
            "tensors in place only inside optimizer.step() (which waits for the copy), or call "
            "ckpt.wait_staged() before the change")


class StepGuard:
    """Installs one pre-step hook per optimizer; the hook waits on the in-flight snapshots' gates.

    ``gates_for(optimizer_id)`` returns the (step, Countdown) pairs to wait for; ``on_wait``
    records how long a step was held back.
    """

    def __init__(self, gates_for: Callable[[int], list], on_wait: Callable[[int, float, float], None]):
        self._gates_for = gates_for
        self._on_wait = on_wait
        self._handles: dict[int, tuple[weakref.ref, object]] = {}

    def watch(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        for optim in optimizers:
            known = self._handles.get(id(optim))
            if known is None or known[0]() is not optim:  # ids of collected objects are reused
                handle = optim.register_step_pre_hook(self._hook)
                self._handles[id(optim)] = (weakref.ref(optim), handle)

    def _hook(self, optim, args, kwargs) -> None:
        for step, gate in self._gates_for(id(optim)):
            if not gate.done():
                start = now()
                gate.wait()
                self._on_wait(step, start, now())

    def close(self) -> None:
        for _, handle in self._handles.values():
            handle.remove()
        self._handles.clear()
