"""Save planning whose work per rank does not grow with the number of ranks.

``plan_save`` (save_plan.py) plans a whole job on every rank from an all-gather of every rank's
item descriptions: at 1024 ranks each rank receives ~236 MB and plans millions of items. Here the
job is split by tensor instead. Every logical tensor (and every shared plain value) has an
*owner*, a rank every rank computes locally from its name (``owner_of``). The save then runs in
phases, each a pure function of what one rank holds or receives:

1. ``route``: every rank sends each item description to the owner of its tensor (O(own items)).
2. ``plan_owned``: an owner sees all pieces of its tensors and nothing else: it deduplicates
   replicas (identical descriptions), picks one writer per distinct piece by a rule that needs
   no global load count, checks that the pieces tile the tensor, and answers every holder which
   of its items it writes, and who writes the others. The rule: each rank sends, with each
   item, where the item lies in its own bytes (the middle of the item, as a fraction of all its
   items' bytes); of the *n* holders of a replica, the one at ``floor(fraction * n)`` writes it.
   Ranks holding the same items in the same order (DDP; a TP group's replicated norms) thus
   split their replicated bytes into *n* nearly equal consecutive runs, one per holder.
3. ``place_writes``: every rank lays out its own file from the items it writes (O(own items)).
4. ``OwnedTensors.entries``: after the writes, every writer reports its offsets and checksums
   to the owners, which build their tensors' manifest entries.

An owner's work is the number of pieces of the tensors it owns: on average the job's items
divided by its ranks, i.e. about one rank's own items; no rank ever holds the whole job.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ..format.dtypes import dtype_from_name
from ..format.manifest import TensorEntry
from ..state.items import ItemMeta
from .save_plan import TensorPieces, align_up, check_tiling, ranks_disagree

# what a rank sends an owner: its item descriptions (with their index in its list and where they
# lie in its bytes, a fraction in [0, 1)) and the names of the shared plain values it holds
Routed = tuple[list[tuple[int, float, ItemMeta]], list[str]]


def owner_of(fqn: str, world: int) -> int:
    """The rank that plans tensor (or shared value) ``fqn``: the same on every rank, from the name
    alone (crc32 is stable across processes and Python versions, unlike ``hash``). A name may hold
    a lone surrogate (a key from ``os.fsdecode`` of a file name's undecodable bytes), which plain
    UTF-8 refuses to encode; the manifest writes it as a ``\\u`` escape and reads it back."""
    return zlib.crc32(fqn.encode("utf-8", "surrogatepass")) % world


def route(metas: Sequence[ItemMeta], objects: Sequence[str], world: int) -> dict[int, Routed]:
    """Phase 1: this rank's items and shared value names, bucketed by owner (owners it sends
    nothing are left out)."""
    out: dict[int, Routed] = {}
    total, before = max(1, sum(meta.nbytes for meta in metas)), 0
    for index, meta in enumerate(metas):
        out.setdefault(owner_of(meta.fqn, world), ([], []))[0].append((index, (before + meta.nbytes / 2) / total, meta))
        before += meta.nbytes
    for fqn in objects:
        out.setdefault(owner_of(fqn, world), ([], []))[1].append(fqn)
    return out


@dataclass
class Decision:
    """What an owner tells one holder: for each of its items the writer (rank, item index), and
    the shared values whose writer the holder is."""

    writers: list[tuple[int, int, int]] = field(default_factory=list)  # (own index, writer rank, writer index)
    objects: list[str] = field(default_factory=list)


@dataclass
class OwnedTensors:
    """An owner's plan of its tensors; offsets and checksums arrive after the writes."""

    tensors: dict[str, TensorPieces]
    decisions: dict[int, Decision]  # holder rank -> its answer

    def entries(self, reports: Mapping[int, dict[int, tuple[int, list[int]]]], file_of_rank: Sequence[int]
                ) -> dict[str, TensorEntry]:
        """Phase 4: the manifest entries of the owned tensors. ``reports[r]``: writer ``r``'s
        item index -> (byte offset, block checksums, ...) of the pieces it wrote for this owner;
        ``file_of_rank[r]``: the index of rank ``r``'s data file in the file table."""
        out = {}
        files = np.asarray(file_of_rank, np.int64)
        for fqn, pieces in self.tensors.items():
            placed = [reports[r][i] for r, i in zip(pieces.rank.tolist(), pieces.item.tolist())]
            checksum, bounds = TensorEntry.pack_checksums([sums for _, sums, *_ in placed])
            out[fqn] = TensorEntry(
                dtype=dtype_from_name(pieces.dtype), shape=pieces.shape, layout=pieces.layout,
                file=files[pieces.rank] if len(pieces.rank) else pieces.rank,
                offset=np.array([offset for offset, *_ in placed], np.int64),
                nbytes=pieces.nbytes, start=pieces.start, size=pieces.size, checksum=checksum,
                checksum_bounds=bounds)
        return out


def plan_owned(inbox: Mapping[int, Routed]) -> OwnedTensors:
    """Phase 2, on an owner: ``inbox[r]`` is what rank ``r`` routed here (ranks that routed
    nothing may be absent)."""
    held: dict[str, list[tuple[int, int, float, ItemMeta]]] = {}
    decisions: dict[int, Decision] = {}
    object_writer: dict[str, int] = {}
    for rank, (items, names) in sorted(inbox.items()):
        for index, where, meta in items:
            held.setdefault(meta.fqn, []).append((rank, index, where, meta))
        for fqn in names:  # the lowest rank holding a shared value writes it, as plan_save does
            if object_writer.setdefault(fqn, rank) == rank:
                decisions.setdefault(rank, Decision()).objects.append(fqn)
    tensors = {}
    for fqn, holders in held.items():
        tensors[fqn] = _plan_tensor(fqn, holders, decisions)
    return OwnedTensors(tensors, decisions)


def _plan_tensor(fqn: str, holders: list[tuple[int, int, float, ItemMeta]], decisions: dict[int, Decision]
                 ) -> TensorPieces:
    """One tensor: its distinct pieces, each with one writer, in (writer rank, item) order."""
    head_rank, head = holders[0][0], holders[0][3]
    kind = (head.dtype, head.shape, head.layout)
    copies: dict[tuple, list[tuple[int, int]]] = {}
    position: dict[tuple, float] = {}  # where the piece lies in its lowest holder's bytes
    for rank, index, where, meta in holders:
        if (meta.dtype, meta.shape, meta.layout) != kind:
            raise ranks_disagree(fqn, head_rank, head, rank, meta)
        key = (meta.start, meta.size, meta.nbytes)
        copies.setdefault(key, []).append((rank, index))
        position.setdefault(key, where)
    chosen = []
    for key, where in copies.items():
        start, size, nbytes = key
        writer = where[min(int(position[key] * len(where)), len(where) - 1)]
        chosen.append((writer, start, size, nbytes))
        for rank, index in where:
            decisions.setdefault(rank, Decision()).writers.append((index, *writer))
    chosen.sort(key=lambda c: c[0])
    dims = len(head.shape) if head.layout == "box" else 1
    n = len(chosen)
    pieces = TensorPieces(
        head.dtype, tuple(head.shape), head.layout,
        rank=np.fromiter((c[0][0] for c in chosen), np.int64, n),
        item=np.fromiter((c[0][1] for c in chosen), np.int64, n),
        offset=np.zeros(n, np.int64), nbytes=np.fromiter((c[3] for c in chosen), np.int64, n),
        start=np.asarray([c[1] for c in chosen], np.int64).reshape(n, dims),
        size=np.asarray([c[2] for c in chosen], np.int64).reshape(n, dims))
    check_tiling(fqn, pieces)
    return pieces


def place_writes(metas: Sequence[ItemMeta], answers: Sequence[Decision], rank: int
                 ) -> tuple[list[tuple[int, int]], int, dict[int, tuple[int, int]]]:
    """Phase 3, on every rank, from the owners' answers: (writes as (item index, byte offset) in
    file order, bytes of the file's pieces, item index -> its writer (rank, index) for the items
    another rank writes)."""
    mine, elsewhere = [], {}
    for answer in answers:
        for index, writer_rank, writer_index in answer.writers:
            if writer_rank == rank:
                mine.append(index)
            else:
                elsewhere[index] = (writer_rank, writer_index)
    mine.sort()
    writes, end = [], 0
    for index in mine:
        if not metas[index].nbytes:  # holds no byte: at 0 it neither pads nor lengthens the file
            writes.append((index, 0))
            continue
        offset = align_up(end)
        writes.append((index, offset))
        end = offset + metas[index].nbytes
    return writes, end, elsewhere
