"""Load targets whose memory overlaps: views of one buffer, weights tied in the state.

A load writes each target in place and checks what it wrote tensor by tensor, as it goes. Where
two targets share memory, the second write can change the first after the first was checked (a
view filled through a host copy, one read in a later request, a restore from host memory, which
checks nothing), and the load would hand back a tensor holding another's values without a word.
So such targets are found (cheaply: only tensors whose storages overlap have their address
ranges compared) and looked at again once every write is done: each must still hold its stored
values. Views that overlap load where the checkpoint stores alike what they share (a tensor and
a row of it, saved so); otherwise no load can give each its own, and they are named.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import torch

from ..errors import StateMismatchError
from ..state.flatten import address_range, same_bits
from ..state.items import TensorItem

Pair = tuple[TensorItem, TensorItem]


def overlapping_pairs(items: Iterable[TensorItem]) -> list[Pair]:
    """The pairs of ``items`` whose tensors may share an element (empty tensors share none; views
    the stride arithmetic cannot tell apart count as sharing). Where some may (or some are not on
    the CPU), items are grouped by storage, a lookup per tensor. Storages whose bytes overlap are
    grouped together (``torch.from_numpy`` of two views of one array gives two storages over one
    memory), and only within a group are the tensors' address ranges compared."""
    items = [item for item in items if item.local.numel()]
    if _apart(items):
        return []
    by_storage: dict[tuple, list[TensorItem]] = {}
    for item in items:
        storage = item.local.untyped_storage()
        device = "cpu" if item.local.is_cpu else str(item.local.device)  # (str(device) is slow to ask)
        key = (device, storage.data_ptr(), storage.nbytes())
        by_storage.setdefault(key, []).append(item)
    pairs: list[Pair] = []
    for group in _overlapping_storages(by_storage):
        if len(group) > 1:
            pairs += _sharing_in(group)
    return pairs


def _apart(items: list[TensorItem]) -> bool:
    """Whether the items are CPU tensors whose address ranges are all disjoint: a model's
    parameters, each in memory of its own, shown so by one sort of their ranges (grouping them
    by storage asks torch for a storage object per tensor, a tenth of a small state's load)."""
    tensors = [item.local for item in items]
    if not all(t.is_cpu for t in tensors):
        return False
    starts = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    spans = np.array([t.nbytes if t.is_contiguous() else address_range(t)[1] - t.data_ptr() for t in tensors],
                     dtype=np.int64)
    ends = starts + spans
    order = np.argsort(starts, kind="stable")
    return bool((ends[order[:-1]] <= starts[order[1:]]).all())


def _overlapping_storages(by_storage: dict[tuple, list[TensorItem]]) -> list[list[TensorItem]]:
    """The items of storages whose byte ranges overlap, merged: a sweep in address order."""
    groups: list[list[TensorItem]] = []
    reach = None  # (device, end) of the current group's furthest byte
    for (device, start, nbytes), group in sorted(by_storage.items(), key=lambda kv: kv[0]):
        if reach is not None and reach[0] == device and start < reach[1]:
            groups[-1] = groups[-1] + group
            reach = (device, max(reach[1], start + nbytes))
        else:
            groups.append(group)
            reach = (device, start + nbytes)
    return groups


_PAIRS_AT_ONCE = 1 << 20  # candidate pairs looked at in one round of array operations (some 64 MB)


def _sharing_in(group: list[TensorItem]) -> list[Pair]:
    """The pairs of the group that may share an element: those whose address ranges overlap,
    less those the stride arithmetic shows apart. Interleaved views (1,000 column blocks of one
    matrix: 500,000 pairs whose ranges overlap) are why this is array operations: a pair is an
    (earlier, later) index in address order, and the arithmetic runs once per distinct (layout,
    layout, distance), a few thousand at most for regular blocks."""
    spans = sorted((*address_range(item.local), index) for index, item in enumerate(group))
    starts = np.array([start for start, _, _ in spans], dtype=np.int64)
    ends = np.array([end for _, end, _ in spans], dtype=np.int64)
    # later[i]: how many of the tensors after the i-th start before it ends
    later = np.maximum(np.searchsorted(starts, ends, side="left") - np.arange(1, len(spans) + 1), 0)
    if not later.any():  # (a flat buffer's views, side by side)
        return []
    kinds: dict[tuple, int] = {}  # a layout less its address -> its number
    kind = np.array([kinds.setdefault(_layout(group[index].local)[1:], len(kinds)) for _, _, index in spans],
                    dtype=np.int64)
    kind_layouts = list(kinds)
    before = np.concatenate([[0], np.cumsum(later)])  # before[i]: the pairs of the tensors before the i-th
    pairs: list[Pair] = []
    first = 0
    while first < len(spans):
        last = max(first + 1, int(np.searchsorted(before, before[first] + _PAIRS_AT_ONCE, side="right")) - 1)
        counts = later[first:last]
        earlier = np.repeat(np.arange(first, last), counts)
        offsets = np.arange(len(earlier)) - np.repeat(np.cumsum(counts) - counts, counts)
        other = earlier + 1 + offsets
        if len(earlier):
            hit = _may_share(kind_layouts, kind[earlier] * len(kinds) + kind[other], starts[other] - starts[earlier])
            pairs += [(group[spans[i][2]], group[spans[j][2]])
                      for i, j in zip(earlier[hit].tolist(), other[hit].tolist())]
        first = last
    return pairs


def _may_share(kind_layouts: list[tuple], kind_pairs: np.ndarray, distances: np.ndarray) -> np.ndarray:
    """For each pair (``kind_pairs``: earlier layout's number times their count plus the later
    one's; ``distances``: bytes between their first elements), whether they may share an
    element. Each distinct (kind pair, distance) is solved once; keys are made dense integers
    first, since sorting rows of an array is several times slower than sorting integers."""
    pair_values, pair_codes = np.unique(kind_pairs, return_inverse=True)
    distance_values, distance_codes = np.unique(distances, return_inverse=True)
    keys, inverse = np.unique(pair_codes.reshape(-1) * len(distance_values) + distance_codes.reshape(-1),
                              return_inverse=True)
    shares = np.empty(len(keys), dtype=bool)
    for at, key in enumerate(keys.tolist()):
        kind_pair, distance = divmod(key, len(distance_values))
        earlier, later = divmod(int(pair_values[kind_pair]), len(kind_layouts))
        shares[at] = not _disjoint_kinds(kind_layouts[earlier], kind_layouts[later], int(distance_values[distance]))
    return shares[inverse.reshape(-1)]


def _layout(t: torch.Tensor) -> tuple:
    """What the stride arithmetic needs of a tensor, asked of torch once per tensor: interleaved
    views of one storage make pairs by the thousand (1,000 column blocks: 500,000)."""
    return t.data_ptr(), t.stride(), tuple(t.shape), t.element_size()


def _disjoint_kinds(x: tuple, y: tuple, byte_distance: int) -> bool:
    """Whether two views with these layouts (less their addresses), ``byte_distance`` apart,
    share no element: the column blocks of one matrix interleave in memory without sharing one.
    Only views with the same strides are told apart."""
    (strides, x_shape, itemsize), (y_strides, y_shape, y_itemsize) = x, y
    if strides != y_strides or itemsize != y_itemsize:
        return False
    return _disjoint_at(byte_distance, strides, x_shape, y_shape, itemsize)


def _disjoint_at(byte_distance: int, strides: tuple, x_shape: tuple, y_shape: tuple, itemsize: int) -> bool:
    """The distance between the two views' first elements is solved for a difference of
    coordinates, largest stride first; where some dimension leaves no difference within both
    views' sizes, no element is shared. Where a dimension leaves more than one, the answer is
    "may share" (False)."""
    distance, remainder = divmod(byte_distance, itemsize)
    if remainder:
        return False
    # per dimension of more than one element: stride, lowest and highest coordinate difference
    dims = sorted(((stride, 1 - b, a - 1) for stride, a, b in zip(strides, x_shape, y_shape) if max(a, b) > 1),
                  reverse=True)
    if any(stride <= 0 for stride, _, _ in dims):
        return False
    for i, (stride, low, high) in enumerate(dims):
        tail_low = sum(s * lo for s, lo, _ in dims[i + 1:])
        tail_high = sum(s * hi for s, _, hi in dims[i + 1:])
        first = max(low, -((tail_high - distance) // stride))  # ceil((distance - tail_high) / stride)
        last = min(high, (distance - tail_low) // stride)
        if first > last:
            return True
        if first < last:
            return False
        distance -= first * stride
    return distance != 0


def same_view(a: TensorItem, b: TensorItem) -> bool:
    """Whether ``a`` and ``b`` are the same elements at the same places (one tensor under two
    names, or two views alike, as FSDP2's ``to_local`` gives for a tied weight): stored alike,
    both writes put the same bytes there."""
    x, y = a.local, b.local
    return (x.data_ptr() == y.data_ptr() and x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
            and x.is_conj() == y.is_conj() and x.is_neg() == y.is_neg())


def aliases_filled(items: list[TensorItem], missing: list[str], unfilled: set[str]) -> set[str]:
    """The names of ``missing`` whose tensor is the same view (:func:`same_view`) as that of an
    item the load fills (not in ``unfilled``): filling the one fills the other."""
    lacking = set(missing)
    if not lacking:
        return set()
    filled, origins = {}, set()
    for item in items:
        if item.fqn not in unfilled:
            filled.setdefault(item.local.data_ptr(), []).append(item)
            origins.add(id(item.origin))
    # (an empty part has no memory to tell by: every rank must judge a name alike, or they part ways)
    return {item.fqn for item in items if item.fqn in lacking and (
        any(same_view(item, other) for other in filled.get(item.local.data_ptr(), ())) if item.local.numel()
        else item.origin is not None and id(item.origin) in origins)}


def overwritten(pairs: list[Pair], stored: Callable[[TensorItem], torch.Tensor | None]) -> list[str] | None:
    """The name of the first tensor of ``pairs`` that no longer holds its stored values after
    every write of the load (``stored(item)``: those values, of the item's shape; None where
    they are not known), followed by the names of the tensors sharing its memory; None if each
    holds its own."""
    holds: dict[int, bool] = {}  # id(item) -> whether it holds its values (each looked at once)
    for a, b in pairs:
        for item in (a, b):
            if id(item) not in holds:
                values = stored(item)
                holds[id(item)] = values is None or same_bits(item.local, values.to(dtype=item.local.dtype))
            if not holds[id(item)]:
                partners = [q.fqn if p is item else p.fqn for p, q in pairs if item is p or item is q]
                return [item.fqn, *dict.fromkeys(partners)]
    return None


def tie_error(names: list[str], where: str) -> StateMismatchError:
    """The error for targets sharing memory that ``where`` holds different values for."""
    listed = ", ".join(repr(name) for name in names[:-1]) + f" and {names[-1]!r}"
    return StateMismatchError(
        f"{listed} share memory in the state (tied weights, or views of one tensor), but {where} holds "
        "different values for them, so no load can give each its own (one write would overwrite another). "
        "That is no damage of the checkpoint.", advice="Give each its own tensor (untie them) to load it.")
