"""Load targets whose memory overlaps: views of one buffer, weights tied in the state.

A load writes each target in place and checks what it wrote tensor by tensor, as it goes. Where
two targets share memory, the second write can change the first after the first was checked (a
view filled through a host copy, one read in a later request, a restore from host memory, which
checks nothing), and the load would hand back a tensor holding another's values without a word.
So such targets are found (cheaply: only tensors sharing a storage have their address ranges
compared) and looked at again once every write is done: each must still hold its stored values.
Views that overlap load where the checkpoint stores alike what they share (a tensor and a row
of it, saved so); otherwise no load can give each its own, and the two are named.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from ..errors import StateMismatchError
from ..state.flatten import address_range, same_bits
from ..state.items import TensorItem


def overlapping_pairs(items: Iterable[TensorItem]) -> list[tuple[TensorItem, TensorItem]]:
    """The pairs of ``items`` whose tensors' memory overlaps (empty tensors overlap nothing).
    Grouping by storage first costs a dict lookup per tensor: a model's parameters each have a
    storage of their own, and only tensors in one storage are sorted by address."""
    by_storage: dict[tuple, list[TensorItem]] = {}
    for item in items:
        if item.local.numel():
            key = (item.local.device, item.local.untyped_storage().data_ptr())
            by_storage.setdefault(key, []).append(item)
    pairs = []
    for group in by_storage.values():
        if len(group) > 1:
            pairs += _overlapping_in(group)
    return pairs


def _overlapping_in(group: list[TensorItem]) -> list[tuple[TensorItem, TensorItem]]:
    """The overlapping pairs of one storage's items: a sweep over their address ranges."""
    spans = sorted((*address_range(item.local), index) for index, item in enumerate(group))
    pairs, open_spans = [], []  # open_spans: (end, index) of the ranges that may reach the next one
    for start, end, index in spans:
        open_spans = [(e, i) for e, i in open_spans if e > start]
        pairs += [(group[i], group[index]) for _, i in open_spans]
        open_spans.append((end, index))
    return pairs


def same_view(a: TensorItem, b: TensorItem) -> bool:
    """Whether ``a`` and ``b`` are the same elements at the same places (one tensor under two
    names, or two views alike): stored alike, both writes put the same bytes there."""
    x, y = a.local, b.local
    return (x.data_ptr() == y.data_ptr() and x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
            and x.is_conj() == y.is_conj() and x.is_neg() == y.is_neg())


def first_overwritten(pairs: list[tuple[TensorItem, TensorItem]],
                      stored: Callable[[TensorItem], torch.Tensor | None]) -> tuple[str, str] | None:
    """The names of the first pair one of whose tensors no longer holds its stored values
    (``stored(item)``: those values, of the item's shape; None where they are not known), after
    every write of the load is done; None if each holds its own."""
    checked: dict[int, bool] = {}  # id(item) -> whether it holds its values (each looked at once)
    for a, b in pairs:
        for item in (a, b):
            if id(item) not in checked:
                values = stored(item)
                checked[id(item)] = values is None or _holds(item.local, values)
        if not (checked[id(a)] and checked[id(b)]):
            return a.fqn, b.fqn
    return None


def _holds(target: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``target`` holds ``values`` bit for bit, compared where the target lives (a GPU
    target is not copied to the host for it)."""
    return same_bits(target, values.to(dtype=target.dtype))


def tie_error(a: str, b: str, where: str) -> StateMismatchError:
    return StateMismatchError(
        f"{a!r} and {b!r} share memory in the state (tied weights, or views of one tensor), but {where} holds "
        "different values for them, so no load can give each its own (the second would overwrite the first). "
        "That is no damage of the checkpoint.", advice="Give each its own tensor (untie them) to load it.")
