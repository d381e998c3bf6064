"""Wrappers a user puts into ``state`` to declare what statesnap cannot infer by itself."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..errors import CheckpointError
from ..format.manifest import BOX, FLAT


class Sharded:
    """A plain tensor that is one rank's part of a larger logical tensor.

    For frameworks that do their own parallelism (Megatron-style TP, ZeRO): give the global shape
    and either the box ``offsets`` of ``local`` in it, or ``flat_offset``, the position of
    ``local.flatten()`` in the row-major flattened global tensor. Ranks that declare the same
    part hold replicas of it: it is written once, by one of them.
    """

    def __init__(self, local: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int] | None = None,
                 *, flat_offset: int | None = None):
        if (offsets is None) == (flat_offset is None):
            raise CheckpointError("Sharded needs exactly one of offsets= (a box) or flat_offset= (a flat range)")
        self.local = local
        self.global_shape = tuple(int(s) for s in global_shape)
        numel = 1
        for s in self.global_shape:
            numel *= s
        if flat_offset is not None:
            self.layout, self.start, self.size = FLAT, (int(flat_offset),), (local.numel(),)
            if not 0 <= flat_offset <= numel - local.numel():
                raise CheckpointError(f"flat range [{flat_offset}, {flat_offset + local.numel()}) lies outside "
                                      f"a tensor of {numel} elements")
        else:
            self.layout, self.start, self.size = BOX, tuple(int(o) for o in offsets), tuple(local.shape)
            if len(self.start) != len(self.global_shape) or len(self.size) != len(self.global_shape):
                raise CheckpointError(f"a box of {len(self.global_shape)} dimensions needs as many offsets and a "
                                      f"local tensor of as many dimensions: offsets {self.start}, local shape "
                                      f"{self.size}, global shape {self.global_shape}")
            if any(o < 0 or o + s > g for o, s, g in zip(self.start, self.size, self.global_shape)):
                raise CheckpointError(f"box at {self.start} of shape {self.size} does not fit in {self.global_shape}")


class Replicated:
    """Declares the tensors in ``value`` replicated: ranks that hold them with the same name,
    dtype and shape may hold different values, and one rank's copy is enough to save.

    Saves compare small replicas across ranks and refuse to commit when they differ, because a
    per-rank value stored once loses the other ranks' values. Wrap what differs on purpose or
    harmlessly (per-rank timing statistics, a wall-clock time, unsynchronised buffers that are
    reset from one rank anyway) to save one copy without the comparison. ``value`` is anything a
    state may hold (a tensor, an ``ss.Sharded``, a module, an optimizer, a dict, plain data); it
    is saved and loaded as if it were not wrapped, and for plain data rank 0's value is kept.
    """

    def __init__(self, value: Any):
        if isinstance(value, (PerRank, Replicated)):
            raise CheckpointError(f"Replicated cannot wrap {type(value).__name__}: a value is either per rank "
                                  "or replicated")
        self.value = value


class PerRank:
    """A value that differs per rank (RNG state, data-loader position): saved for every rank.

    Loading into a different world size is an error unless ``on_resize`` says what to do:
    ``"rank0"`` (everyone takes rank 0's value), ``"skip"`` (keep the current value), or a
    callable ``f(values_by_old_rank, new_rank, new_world_size) -> value``. After a load the
    loaded value is in ``.value``; if it wraps a stateful object, its ``load_state_dict`` is called.
    """

    def __init__(self, value: Any, on_resize: str | Callable = "error"):
        if not callable(on_resize) and on_resize not in ("error", "rank0", "skip"):
            raise CheckpointError(f"on_resize must be 'error', 'rank0', 'skip' or a callable, not {on_resize!r}")
        self.value = value
        self.on_resize = on_resize

    def snapshot(self) -> Any:
        return self.value.state_dict() if hasattr(self.value, "state_dict") else self.value

    def restore(self, loaded: Any) -> None:
        if hasattr(self.value, "load_state_dict"):
            self.value.load_state_dict(loaded)
        else:
            self.value = loaded

    def choose(self, values: list, rank: int, world_size: int, fqn: str) -> tuple[bool, Any]:
        """(found, value) for ``rank`` given the values saved by each old rank."""
        if len(values) == world_size:
            return True, values[rank]
        if self.on_resize == "rank0":
            return True, values[0]
        if self.on_resize == "skip":
            return False, None
        if callable(self.on_resize):
            return True, self.on_resize(values, rank, world_size)
        from ..errors import ReshardError
        raise ReshardError(f"{fqn}: per-rank state was saved by {len(values)} ranks but is loaded by "
                           f"{world_size}; pass PerRank(..., on_resize='rank0'|'skip'|callable) to say how "
                           "to map it")


def flat_partition(local: torch.Tensor, params: Sequence[tuple[str, Sequence[int]]], start: int) -> dict[str, Sharded]:
    """Describe a ZeRO-style flat shard: ``local`` is the range ``[start, start + local.numel())``
    of the concatenation of the flattened ``params`` (``(fqn, shape)`` in buffer order).

    Returns ``{fqn: Sharded}`` for every parameter the range overlaps; put it in ``state``. The
    entries are views of ``local``, so loading fills the flat buffer in place.
    """
    flat = local.reshape(-1)
    if flat.data_ptr() != local.data_ptr() or not local.is_contiguous():
        raise CheckpointError("flat_partition needs a contiguous local buffer")
    end = start + flat.numel()
    out: dict[str, Sharded] = {}
    param_start = 0
    for fqn, shape in params:
        numel = 1
        for s in shape:
            numel *= int(s)
        lo, hi = max(start, param_start), min(end, param_start + numel)
        if hi > lo or (numel == 0 and start <= param_start < end):
            out[fqn] = Sharded(flat[lo - start:hi - start], shape, flat_offset=lo - param_start)
        param_start += numel
    return out
