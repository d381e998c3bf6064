"""Whole pieces of one checksum block each, read column by column.

Loading a state of many small tensors (a thousand of a few KiB, as one rank of a large model
holds) is mostly bookkeeping: planned, grouped and checked as an object each, their reads took
longer than the bytes did. Here such pieces stay columns: their places in the files and their
checksums are gathered from the entries' arrays in a few numpy calls, sorted and cut into
requests at once, and each request is one vectored read followed by one hash per piece. Pieces
of more than one block are handed back to be read as jobs (engine/read.py), which split them
at block boundaries to hash each block while it is still in the CPU caches.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from ..format.manifest import TensorEntry

GROUP_BYTES = 16 << 20  # about what stays in the CPU caches between the read and its checksum
# Neighbouring pieces this close in a file are read in one request, the bytes between them into a
# scratch buffer: pieces start on 64-byte boundaries, so a thousand small tensors would otherwise
# be a thousand requests, each handed to a read thread (most of such a load's time).
GAP_BYTES = 4096
GROUP_JOBS = 256  # pieces per request at most: within one preadv's IOV_MAX, and spread over the threads


@dataclasses.dataclass(slots=True)
class PieceRun:
    """One request: the pieces ``members`` (indices into ``Columns``), in file order, that lie
    within ``GAP_BYTES`` of each other in the file ``file`` from byte ``start`` to ``end``."""
    file: int
    start: int
    end: int
    members: list[int]


@dataclasses.dataclass(slots=True)
class Columns:
    """Per piece: its tensor (``owner``, an index into ``WholePieces``), its number among the
    tensor's pieces, its place in its file, its checksum and its own bytes in the tensor (``view``)."""
    owner: list[int]
    piece: list[int]
    base: list[int]
    size: list[int]
    checksum: list[int]
    view: list[memoryview]


class WholePieces:
    """The pieces a load reads whole into contiguous byte ranges of its targets."""

    def __init__(self):
        self.fqns: list[str] = []
        self.entries: list[TensorEntry] = []
        self.views: list[memoryview] = []
        self.offsets: list[list[int]] = []  # per tensor, where each of its pieces lands in its view
        self.targets: list[torch.Tensor] = []  # held for as long as their views are used

    def add(self, fqn: str, entry: TensorEntry, target: torch.Tensor, view: memoryview, offsets: list[int]) -> None:
        self.fqns.append(fqn)
        self.entries.append(entry)
        self.targets.append(target)
        self.views.append(view)
        self.offsets.append(offsets)

    def __len__(self) -> int:
        return len(self.fqns)

    def plan(self) -> tuple[Columns, list[PieceRun], list[tuple[int, int]]]:
        """(the pieces of one block as columns, their requests, (tensor, piece) of the others).
        Empty pieces are neither: nothing is read into them."""
        counts, owner, piece, file, base, size, blocks, sums = _pieces_of(self.entries)
        one_block, larger = (size > 0) & (blocks == 1), (size > 0) & (blocks != 1)
        keep = np.flatnonzero(one_block)
        order = keep[np.lexsort((base[keep], file[keep]))]
        columns = Columns(owner.tolist(), piece.tolist(), base.tolist(), size.tolist(), sums.tolist(), self.views)
        if (counts != 1).any():  # a piece's own bytes: its tensor's where it is the only piece, else a slice
            views, dst = self.views, itertools.chain.from_iterable(self.offsets)
            columns.view = [views[o] if n == len(views[o]) else views[o][d:d + n] if one else None
                            for o, d, n, one in zip(columns.owner, dst, columns.size, one_block.tolist())]
        return (columns, _runs(file[order], base[order], size[order], order),
                list(zip(owner[larger].tolist(), piece[larger].tolist())))


def _pieces_of(entries: list[TensorEntry]) -> tuple[np.ndarray, ...]:
    """Pieces per entry, then per piece in the entries' order: its entry (an index into
    ``entries``), its number there, its file, offset and bytes, its checksum blocks and its first
    block's checksum."""
    groups: dict[int, tuple] = {}
    for i, entry in enumerate(entries):
        rows = entry.group
        if rows is None:
            return _pieces_one_by_one(entries)
        group = groups.get(id(rows)) or groups.setdefault(id(rows), (rows, [], []))
        group[1].append(i)
        group[2].append(entry.row)
    counts = np.empty(len(entries), np.int64)
    parts = []
    for rows, owners, of in groups.values():
        owners, of = np.asarray(owners, np.int64), np.asarray(of, np.int64)
        n = rows.file.shape[1]
        counts[owners] = n
        parts.append((np.repeat(owners, n), np.tile(np.arange(n), len(of)), rows.file[of].ravel(),
                      rows.offset[of].ravel(), rows.nbytes[of].ravel(), np.diff(rows.bounds[of], axis=1).ravel(),
                      rows.first_checksums(of).ravel()))
    columns = [np.concatenate(column) for column in zip(*parts)]
    if len(parts) > 1:  # (back in the entries' order)
        order = np.argsort(columns[0], kind="stable")
        columns = [column[order] for column in columns]
    return (counts, *columns)


def _pieces_one_by_one(entries: list[TensorEntry]) -> tuple[np.ndarray, ...]:
    """``_pieces_of`` gathered from each entry's own arrays (some were not read in rows)."""
    files, offsets, sizes, all_bounds, all_sums = zip(*[(e.file, e.offset, e.nbytes, e.checksum_bounds, e.checksum)
                                                        for e in entries])
    counts = np.fromiter(map(len, files), np.int64, len(entries))
    owner = np.repeat(np.arange(len(entries)), counts)
    piece = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    file, base, size, bounds = (np.concatenate(arrays).astype(np.int64, copy=False)
                                for arrays in (files, offsets, sizes, all_bounds))
    # each tensor's checksum bounds back to back, less its end: where each piece's checksums start
    ends = np.cumsum(counts + 1) - 1
    blocks = np.delete(np.diff(bounds), ends[:-1])  # (less the differences across two tensors)
    sums_of = np.fromiter(map(len, all_sums), np.int64, len(entries))
    first_sum = np.delete(bounds, ends) + np.repeat(np.cumsum(sums_of) - sums_of, counts)
    sums = np.concatenate(all_sums)
    return counts, owner, piece, file, base, size, blocks, sums[np.minimum(first_sum, len(sums) - 1)]


def _runs(file: np.ndarray, base: np.ndarray, size: np.ndarray, index: np.ndarray) -> list[PieceRun]:
    """The pieces at ``index`` (sorted by file and offset) cut into requests: a new one where the
    file changes, the next piece lies more than ``GAP_BYTES`` on (or overlaps the last), or the
    request would pass ``GROUP_JOBS`` pieces or ``GROUP_BYTES`` bytes."""
    if not len(index):
        return []
    end = base + size
    gap = base[1:] - end[:-1]
    apart = np.concatenate([[True], (file[1:] != file[:-1]) | (gap < 0) | (gap > GAP_BYTES)])
    stretch = np.cumsum(apart) - 1  # which run of near pieces each one is in
    first = np.flatnonzero(apart)
    within = np.arange(len(index)) - first[stretch]
    filled = np.cumsum(size) - np.cumsum(size)[first][stretch] + size[first][stretch] - size  # bytes before it
    # a run of near pieces is cut every GROUP_JOBS pieces and every GROUP_BYTES bytes
    cut = apart | np.concatenate([[False], (within[1:] // GROUP_JOBS != within[:-1] // GROUP_JOBS)
                                  | (filled[1:] // GROUP_BYTES != filled[:-1] // GROUP_BYTES)])
    starts = np.flatnonzero(cut).tolist()
    index, file, base, end = index.tolist(), file.tolist(), base.tolist(), end.tolist()
    return [PieceRun(file[a], base[a], end[b - 1], index[a:b]) for a, b in zip(starts, [*starts[1:], len(index)])]
