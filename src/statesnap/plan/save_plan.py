"""Save planning: dedup replicas, balance the writing by bytes, fix every byte offset up front.

Pure computation over the item descriptions of all ranks (no I/O, no process groups), so it can
be simulated for a thousand ranks in one process. Every rank runs it on the same all-gathered
input and gets the same answer, which saves a scatter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..errors import CheckpointError
from ..state.items import ItemMeta

ALIGN = 64  # pieces start on cache-line boundaries so direct reads land aligned in memory


@dataclass
class PlannedPiece:
    rank: int
    item: int  # index into that rank's item list
    offset: int
    meta: ItemMeta


@dataclass
class SavePlan:
    world_size: int
    # per rank: (item index, byte offset in that rank's data file), in file order
    writes: list[list[tuple[int, int]]]
    file_bytes: list[int]
    # per fqn: (dtype, shape, layout) and its pieces in a deterministic order
    tensors: dict[str, tuple[str, tuple, str]] = field(default_factory=dict)
    pieces: dict[str, list[PlannedPiece]] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.file_bytes)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_save(per_rank: Sequence[Sequence[ItemMeta]]) -> SavePlan:
    """Assign each distinct piece to one holder, least-loaded first, largest pieces first."""
    world = len(per_rank)
    holders: dict[tuple, list[tuple[int, int]]] = {}
    described: dict[str, tuple[str, tuple, str]] = {}
    for rank, metas in enumerate(per_rank):
        for index, meta in enumerate(metas):
            kind = (meta.dtype, meta.shape, meta.layout)
            known = described.setdefault(meta.fqn, kind)
            if known != kind:
                raise CheckpointError(f"{meta.fqn}: ranks disagree on dtype/shape/layout ({known} vs {kind})")
            holders.setdefault((meta.fqn, meta.start, meta.size), []).append((rank, index))

    load = [0] * world
    chosen: dict[int, list[tuple[int, ItemMeta]]] = {r: [] for r in range(world)}
    singles = [(key, hs[0]) for key, hs in holders.items() if len(hs) == 1]
    for key, (rank, index) in singles:
        meta = per_rank[rank][index]
        chosen[rank].append((index, meta))
        load[rank] += meta.nbytes
    shared = [(per_rank[hs[0][0]][hs[0][1]].nbytes, key, hs) for key, hs in holders.items() if len(hs) > 1]
    shared.sort(key=lambda t: (-t[0], t[1][0], t[1][1]))
    for nbytes, _key, hs in shared:
        rank, index = min(hs, key=lambda h: (load[h[0]], h[0]))
        chosen[rank].append((index, per_rank[rank][index]))
        load[rank] += nbytes

    writes: list[list[tuple[int, int]]] = []
    file_bytes: list[int] = []
    pieces: dict[str, list[PlannedPiece]] = {fqn: [] for fqn in described}
    for rank in range(world):
        offset, rank_writes = 0, []
        for index, meta in sorted(chosen[rank]):
            rank_writes.append((index, offset))
            pieces[meta.fqn].append(PlannedPiece(rank, index, offset, meta))
            offset = _align(offset + meta.nbytes)
        writes.append(rank_writes)
        file_bytes.append(offset)
    _check_no_overlap(pieces)
    return SavePlan(world, writes, file_bytes, described, pieces)


def _check_no_overlap(pieces: dict[str, list[PlannedPiece]]) -> None:
    """Distinct pieces of one tensor must not overlap: a partial overlap means ranks disagree
    about the layout, and loading would be ambiguous."""
    for fqn, plist in pieces.items():
        if len(plist) < 2:
            continue
        total = sum(_volume(p.meta.size) for p in plist)
        meta = plist[0].meta
        limit = _volume(meta.shape)
        if total > limit:
            raise CheckpointError(f"{fqn}: the ranks' pieces overlap ({total} elements stored for a tensor of "
                                  f"{limit}); the ranks disagree about how it is sharded")


def _volume(extent: Sequence[int]) -> int:
    n = 1
    for e in extent:
        n *= e
    return n
