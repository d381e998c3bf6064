"""Save planning: dedup replicas, balance the writing by bytes, fix every byte offset up front.

Pure computation over the item descriptions of all ranks (no I/O, no process groups), so it can
be simulated for a thousand ranks in one process. Every rank runs it on the same all-gathered
input and gets the same answer, which saves a scatter.

At 1024 ranks the input holds millions of items, so the work is columnar: one pass of Python
dict lookups gives every item the id of the first identical item (identical descriptions are
replicas), and everything after that (holder counts, balancing of the few replicated pieces,
per-file offsets, per-tensor piece tables) is numpy over those ids.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain, count
from operator import attrgetter
from typing import Sequence

import numpy as np

from ..errors import CheckpointError
from ..format.boxes import first_outside, region, tiling_problem
from ..format.columns import INT64_MAX
from ..format.dtypes import dtype_from_name
from ..format.manifest import BOX
from ..state.items import ItemMeta

ALIGN = 64  # pieces start on cache-line boundaries so direct reads land aligned in memory


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class TensorPieces:
    """One logical tensor and its distinct stored pieces, column-wise (the manifest's shape)."""

    dtype: str
    shape: tuple
    layout: str
    rank: np.ndarray  # the rank that writes each piece
    item: np.ndarray  # index of the piece in that rank's item list
    offset: np.ndarray  # byte offset in that rank's data file
    nbytes: np.ndarray
    start: np.ndarray  # (pieces, dims): box offsets, or one column with the flat start
    size: np.ndarray


@dataclass
class SavePlan:
    world_size: int
    # per rank: (item index, byte offset in that rank's data file), in file order
    writes: list[list[tuple[int, int]]]
    file_bytes: list[int]
    tensors: dict[str, TensorPieces]
    # shared plain value -> the rank that writes it: the lowest rank holding it (pipeline stages
    # hold different values; rank 0 need not hold them all)
    object_writers: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.file_bytes)


def plan_save(per_rank: Sequence[Sequence[ItemMeta]], objects: Sequence[Sequence[str]] = ()) -> SavePlan:
    """Assign each distinct piece to one holder: pieces only one rank has stay there; replicated
    ones go, largest first, to the least-loaded of their holders. ``objects[r]`` names the shared
    plain values rank ``r`` holds; each is written by the lowest rank holding it."""
    world = len(per_rank)
    per_rank_counts = np.fromiter(map(len, per_rank), np.int64, world)
    metas = list(chain.from_iterable(per_rank))
    total = len(metas)
    first_seen: dict[ItemMeta, int] = {}
    # position of the first identical description: replicas share it
    first = np.fromiter(map(first_seen.setdefault, metas, count()), np.int64, total)
    rank = np.repeat(np.arange(world, dtype=np.int64), per_rank_counts)
    index = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(per_rank_counts) - per_rank_counts, per_rank_counts)
    nbytes = np.fromiter(map(attrgetter("nbytes"), metas), np.int64, total)

    chosen = _choose_holders(first, rank, nbytes, world)  # one position per distinct piece, ascending
    chosen_rank, aligned = rank[chosen], -(-nbytes[chosen] // ALIGN) * ALIGN
    ends = np.cumsum(aligned)
    rank_start = np.searchsorted(chosen_rank, np.arange(world + 1))
    base = np.concatenate([[0], ends])[rank_start]
    offset = ends - aligned - np.repeat(base[:-1], np.diff(rank_start))
    offset[nbytes[chosen] == 0] = 0  # holds no byte: at 0 it neither pads nor lengthens the file
    # a file ends with its last byte: the alignment gaps are only *between* pieces
    data_end = offset + nbytes[chosen]
    has_pieces = rank_start[1:] > rank_start[:-1]
    file_bytes = np.zeros(world, np.int64)
    if has_pieces.any():
        file_bytes[has_pieces] = np.maximum.reduceat(data_end, rank_start[:-1][has_pieces])
    file_bytes = file_bytes.tolist()
    items, offsets = index[chosen].tolist(), offset.tolist()
    writes = [list(zip(items[a:b], offsets[a:b])) for a, b in zip(rank_start[:-1], rank_start[1:])]
    tensors = _tensor_tables(list(map(metas.__getitem__, chosen.tolist())), chosen_rank, index[chosen], offset,
                             nbytes[chosen])
    writers: dict[str, int] = {}
    for rank_of, names in enumerate(objects):
        for fqn in names:
            writers.setdefault(fqn, rank_of)
    return SavePlan(world, writes, file_bytes, tensors, writers)


def _choose_holders(first: np.ndarray, rank: np.ndarray, nbytes: np.ndarray, world: int) -> np.ndarray:
    """Positions of the items that will be written, sorted (= by rank, then item index)."""
    holders = np.bincount(first, minlength=len(first))
    single = holders[first] == 1
    load = np.bincount(rank[single], weights=nbytes[single], minlength=world).astype(np.int64).tolist()
    shared_keys = np.nonzero(holders > 1)[0]
    replicas = np.nonzero(~single)[0]
    replicas = replicas[np.argsort(first[replicas], kind="stable")]
    bounds = np.searchsorted(first[replicas], shared_keys)
    picked = []
    order = np.lexsort((shared_keys, -nbytes[shared_keys]))  # largest first, ties by position
    rank_list, key_bytes = rank[replicas].tolist(), nbytes[shared_keys].tolist()
    bounds_list, replica_list = bounds.tolist() + [len(replicas)], replicas.tolist()
    for k in order.tolist():
        holders = range(bounds_list[k], bounds_list[k + 1])
        best = min(holders, key=lambda i: load[rank_list[i]])  # lowest rank wins ties
        load[rank_list[best]] += key_bytes[k]
        picked.append(replica_list[best])
    return np.sort(np.concatenate([np.nonzero(single)[0], np.asarray(picked, dtype=np.int64)]))


def _kind(meta: ItemMeta) -> tuple:
    return meta.dtype, meta.shape, meta.layout


def ranks_disagree(fqn: str, rank: int, meta: ItemMeta, other_rank: int, other: ItemMeta) -> CheckpointError:
    """The error for two ranks holding one name as tensors of another dtype, shape or layout."""
    def held(meta: ItemMeta) -> str:
        return f"{meta.dtype} of shape {tuple(meta.shape)}" + (" (flat shards)" if meta.layout != BOX else "")
    return CheckpointError(
        f"tensor {fqn!r}: rank {rank} holds it as {held(meta)} and rank {other_rank} as {held(other)}; the ranks of "
        "one checkpoint hold one tensor under each name: give every rank the same dtype and shape (a DTensor or "
        "ss.Sharded for a sharded one), or a name of its own to a tensor each rank holds for itself")


def _tensor_tables(metas: list[ItemMeta], rank: np.ndarray, item: np.ndarray, offset: np.ndarray,
                   nbytes: np.ndarray) -> dict[str, TensorPieces]:
    """Group the chosen pieces by tensor (in rank order) and check that the ranks agree."""
    kinds = set(map(attrgetter("fqn", "dtype", "shape", "layout"), metas))
    fqns = list(map(attrgetter("fqn"), metas))
    fqn_ids = {fqn: i for i, fqn in enumerate(dict.fromkeys(fqns))}
    fqn_of = np.fromiter(map(fqn_ids.__getitem__, fqns), np.int64, len(metas))
    if len(kinds) != len(fqn_ids):
        seen: dict[str, tuple] = {}
        for meta, holder in zip(metas, rank.tolist()):
            first = seen.setdefault(meta.fqn, (holder, meta))
            if _kind(first[1]) != _kind(meta):
                raise ranks_disagree(meta.fqn, *first, holder, meta)
    order = np.argsort(fqn_of, kind="stable")
    bounds = np.searchsorted(fqn_of[order], np.arange(len(fqn_ids) + 1)).tolist()
    heads = [metas[order[b]] for b in bounds[:-1]]
    dims = np.asarray([len(h.shape) if h.layout == BOX else 1 for h in heads], np.int64)
    # boxes read in the items' own order (memory order: far fewer cache misses than by tensor),
    # then gathered per tensor with index arithmetic
    item_dims = dims[fqn_of]
    first_int = np.cumsum(item_dims) - item_dims
    starts = np.fromiter(chain.from_iterable(map(attrgetter("start"), metas)), np.int64, int(item_dims.sum()))
    sizes = np.fromiter(chain.from_iterable(map(attrgetter("size"), metas)), np.int64, len(starts))
    tables = {}
    for fid, (fqn, head) in enumerate(zip(fqn_ids, heads)):
        sel = order[bounds[fid]:bounds[fid + 1]]
        where = first_int[sel][:, None] + np.arange(dims[fid])
        tables[fqn] = TensorPieces(head.dtype, tuple(head.shape), head.layout, rank[sel], item[sel], offset[sel],
                                   nbytes[sel], starts[where], sizes[where])
        check_tiling(fqn, tables[fqn])
    return tables


def check_tiling(fqn: str, pieces: TensorPieces) -> None:
    """The distinct pieces of one tensor must lie inside it and cover it exactly once
    (docs/format.md §4). A piece outside, two that overlap or a hole mean the ranks disagree
    about how the tensor is sharded: a load would be ambiguous or would leave elements stale."""
    numel = math.prod(pieces.shape)
    itemsize = dtype_from_name(pieces.dtype).itemsize
    if not all(0 <= s <= INT64_MAX for s in pieces.shape) or numel * itemsize > INT64_MAX:
        raise CheckpointError(f"{fqn}: global shape {list(pieces.shape)} is negative or holds more than "
                              "2**63 - 1 bytes")
    limit = pieces.shape if pieces.layout == BOX else (numel,)
    if len(pieces.start) == 1 and pieces.size[0].tolist() == list(limit) and not pieces.start[0].any():
        return  # one piece that is the whole tensor: most tensors of a job without sharding

    def describe(i: int) -> str:
        return f"rank {int(pieces.rank[i])}'s piece {region(pieces.start[i], pieces.start[i] + pieces.size[i])}"

    outside = first_outside(pieces.start, pieces.size, limit)
    if outside >= 0:
        raise CheckpointError(f"{fqn}: {describe(outside)} lies outside its global shape {list(pieces.shape)}")
    problem = tiling_problem(limit, pieces.start, pieces.size, describe)
    if problem:
        flat = " (flat ranges of the row-major tensor)" if pieces.layout != BOX else ""
        raise CheckpointError(f"{fqn}: the ranks' pieces{flat} must cover it exactly once, but {problem}; "
                              "how it is sharded (ss.Sharded offsets, DTensor placements) is inconsistent "
                              "across ranks or leaves part of it out")
