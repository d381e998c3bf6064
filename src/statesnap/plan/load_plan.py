"""Load planning: which byte ranges of which stored pieces fill a target's local tensor.

Pure computation. For a target part of a logical tensor it finds the stored pieces that overlap
it (vectorised over all pieces of the tensor) and, per overlapping piece, either

* direct *segments*: byte ranges that are contiguous both in the file and in the target, read
  straight into the target's memory with no extra copy; or
* a *box copy*: when the overlap is strided on one side, the minimal contiguous byte span of the
  piece is read once and the overlap is copied out of it with one strided tensor copy.

Flat ranges (ZeRO) and boxes meet in flattened coordinates: a box becomes the runs of the
row-major flattened tensor it covers, and runs intersect as 1-D intervals.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..format.dtypes import itemsize
from ..format.manifest import BOX, FEW_PIECES, FLAT, TensorEntry


@dataclass
class Segment:
    src: int  # byte offset relative to the piece start
    dst: int  # byte offset in the target's contiguous local buffer
    nbytes: int


@dataclass
class BoxCopy:
    """Copy the box ``sizes`` starting at element ``piece_start`` of the piece (row-major
    ``piece_shape``) to ``dst_start`` within the target's local box."""

    piece_shape: tuple
    piece_start: tuple
    sizes: tuple
    dst_start: tuple


@dataclass
class PieceRead:
    piece: int
    lo: int  # needed byte range of the piece, relative to its start
    hi: int
    segments: list[Segment] = field(default_factory=list)
    box: BoxCopy | None = None


@dataclass
class TargetPlan:
    reads: list[PieceRead]
    # Elements of the target that stored pieces cover. Exact, not a count that overlaps could
    # inflate: every save plan and every parsed manifest holds each element exactly once
    # (format/boxes.py), and empty pieces intersect nothing, so they are neither read nor counted.
    covered: int


def row_major_strides(shape: Sequence[int]) -> list[int]:
    """Element strides of a contiguous row-major array of ``shape``, as plain integers."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


def _strides(shape: Sequence[int]) -> np.ndarray:
    return np.array(row_major_strides([int(x) for x in shape]), dtype=np.int64)


def is_contiguous_part(sizes: Sequence[int], full: Sequence[int]) -> bool:
    """Is the box ``sizes`` a contiguous byte range of a row-major array of shape ``full``?"""
    d = 0
    while d < len(sizes) and sizes[d] == 1:
        d += 1
    return all(sizes[e] == full[e] for e in range(d + 1, len(sizes)))


def box_runs(start: Sequence[int], size: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """Runs ``[global_flat_start, length, local_elem_offset]`` of a box in a row-major tensor."""
    nd = len(shape)
    if nd == 0:
        return np.array([[0, 1, 0]], dtype=np.int64)
    if any(s == 0 for s in size):
        return np.zeros((0, 3), dtype=np.int64)
    j = nd - 1
    while j >= 0 and size[j] == shape[j]:
        j -= 1
    if j < 0:
        return np.array([[0, int(np.prod(shape)), 0]], dtype=np.int64)
    gstride, lstride = _strides(shape), _strides(size)
    length = int(size[j] * gstride[j])
    grids = np.indices(tuple(size[:j]), dtype=np.int64).reshape(j, -1) if j else np.zeros((0, 1), np.int64)
    base = np.asarray(start[:j], dtype=np.int64)[:, None]
    gstart = ((grids + base) * gstride[:j, None]).sum(axis=0) + start[j] * gstride[j]
    lstart = (grids * lstride[:j, None]).sum(axis=0) + 0
    return np.stack([gstart, np.full_like(gstart, length), lstart], axis=1)


def plan_target(entry: TensorEntry, layout: str, start: Sequence[int], size: Sequence[int]) -> TargetPlan:
    """Plan the reads that fill a target part (``layout``/``start``/``size``) of ``entry``."""
    isz = itemsize(entry.dtype)
    if entry.layout == BOX and layout == BOX:
        return _plan_box_box(entry, tuple(start), tuple(size), isz)
    return _plan_flat(entry, layout, tuple(start), tuple(size), isz)


def _plan_box_box(entry: TensorEntry, t0: tuple, ts: tuple, isz: int) -> TargetPlan:
    nd = len(entry.shape)
    if nd == 0:
        reads = [PieceRead(i, 0, int(entry.nbytes[i]), [Segment(0, 0, int(entry.nbytes[i]))])
                 for i in range(min(1, entry.num_pieces))]
        return TargetPlan(reads, len(reads))
    if entry.num_pieces <= FEW_PIECES and ts == tuple(entry.shape) and not any(t0):
        return plan_whole(entry)
    te = tuple(a + b for a, b in zip(t0, ts))
    if entry.num_pieces > FEW_PIECES:  # the overlap search vectorised, the few hits in plain Python
        lo = np.maximum(entry.start, np.asarray(t0, np.int64))
        hi = np.minimum(entry.start + entry.size, np.asarray(te, np.int64))
        hit = np.nonzero((hi > lo).all(axis=1))[0].tolist()
        pieces = zip(hit, entry.start[hit].tolist(), entry.size[hit].tolist())
    else:  # numpy's per-call cost would be most of planning a tensor of a few pieces
        pieces = zip(range(entry.num_pieces), entry.start.tolist(), entry.size.tolist())
    reads, covered = [], 0
    tstride = row_major_strides(ts)
    for i, pstart, pshape in pieces:
        lo = [max(p, t) for p, t in zip(pstart, t0)]
        n = [min(p + z, t) - l for p, z, t, l in zip(pstart, pshape, te, lo)]
        if min(n) <= 0:
            continue
        a = [l - p for l, p in zip(lo, pstart)]
        b = [l - t for l, t in zip(lo, t0)]
        pstride = row_major_strides(pshape)
        first = sum(x * y for x, y in zip(a, pstride))
        last = sum((x + m - 1) * y for x, m, y in zip(a, n, pstride))
        count = math.prod(n)
        covered += count
        if is_contiguous_part(n, pshape) and is_contiguous_part(n, ts):
            dst = sum(x * y for x, y in zip(b, tstride)) * isz
            reads.append(PieceRead(i, first * isz, (first + count) * isz, [Segment(first * isz, dst, count * isz)]))
        else:
            reads.append(PieceRead(i, first * isz, (last + 1) * isz,
                                   box=BoxCopy(tuple(pshape), tuple(a), tuple(n), tuple(b))))
    return TargetPlan(reads, covered)


def piece_offsets(entry: TensorEntry, layout: str, start: Sequence[int], size: Sequence[int]) -> list[int] | None:
    """Where each stored piece of ``entry`` lands, in bytes from the start of a target part that
    is the whole tensor, when the entry's up to ``FEW_PIECES`` box pieces are runs of whole rows
    that together cover the tensor: such a target is read without a plan. Most are: a load in
    the layout of its save (one piece), or of a checkpoint of a few ranks split by rows. None for
    any other (``plan_target`` plans it; a split manifest's entry may hold only some pieces)."""
    shape = entry.shape
    if layout != BOX or tuple(size) != shape or any(start):
        return None
    if entry.whole_in_one_piece:
        return [0]
    group = entry.group
    if group is not None:  # (worked out for all the entries read with it)
        return group.in_whole[entry.row]
    if entry.layout != BOX or entry.num_pieces > FEW_PIECES:
        return None
    rows, starts, sizes = list(shape[1:]), entry.start.tolist(), entry.size.tolist()
    if not shape or any(box[1:] != rows for box in sizes) or sum(box[0] for box in sizes) != shape[0]:
        return None  # (a piece of whole rows starts at column 0 of them: the manifest's boxes lie inside the shape)
    row_bytes = math.prod(rows) * entry.dtype.itemsize
    return [first[0] * row_bytes for first in starts]


def plan_whole(entry: TensorEntry) -> TargetPlan:
    """The plan of a target that is the whole tensor, for an entry of up to ``FEW_PIECES`` box
    pieces (a same-layout load in one process, or a checkpoint of a few ranks loaded by one):
    each piece lands whole at its own box, so there is nothing to intersect."""
    shape, isz = entry.shape, entry.dtype.itemsize
    reads, covered, stride, rows = [], 0, None, list(shape[1:])
    for i, (pstart, pshape) in enumerate(zip(entry.start.tolist(), entry.size.tolist())):
        count = math.prod(pshape)
        if not count:
            continue
        covered += count
        nbytes = count * isz
        if pshape[1:] == rows or is_contiguous_part(pshape, shape):  # whole rows (the commonest split) first
            stride = stride or row_major_strides(shape)
            reads.append(PieceRead(i, 0, nbytes, [Segment(0, sum(map(operator.mul, pstart, stride)) * isz, nbytes)]))
        else:
            reads.append(PieceRead(i, 0, nbytes, box=BoxCopy(tuple(pshape), (0,) * len(shape), tuple(pshape),
                                                            tuple(pstart))))
    return TargetPlan(reads, covered)


def _runs_of(layout: str, start: tuple, size: tuple, shape: tuple) -> np.ndarray:
    if layout == FLAT:
        return np.array([[start[0], size[0], 0]], dtype=np.int64) if size[0] else np.zeros((0, 3), np.int64)
    return box_runs(start, size, shape)


def _plan_flat(entry: TensorEntry, layout: str, t0: tuple, ts: tuple, isz: int) -> TargetPlan:
    target = _runs_of(layout, t0, ts, entry.shape)
    if not len(target):
        return TargetPlan([], 0)
    tmin, tmax = int(target[:, 0].min()), int((target[:, 0] + target[:, 1]).max())
    if entry.layout == FLAT:
        pmin, pmax = entry.start[:, 0], entry.start[:, 0] + entry.size[:, 0]
    else:
        gstride = _strides(entry.shape)
        pmin = (entry.start * gstride).sum(axis=1)
        pmax = ((entry.start + entry.size - 1) * gstride).sum(axis=1) + 1
        pmax = np.where((entry.size > 0).all(axis=1), pmax, pmin)
    hit = np.nonzero((pmin < tmax) & (pmax > tmin))[0]
    reads, covered = [], 0
    for i in hit:
        piece = _runs_of(entry.layout, tuple(entry.start[i]), tuple(entry.size[i]), entry.shape)
        segments = _intersect_runs(target, piece, isz)
        if segments:
            covered += sum(s.nbytes for s in segments) // max(isz, 1)
            reads.append(PieceRead(int(i), min(s.src for s in segments),
                                   max(s.src + s.nbytes for s in segments), segments))
    return TargetPlan(reads, covered)


def _intersect_runs(target: np.ndarray, piece: np.ndarray, isz: int) -> list[Segment]:
    """Overlaps of two sorted run lists, as byte segments (piece-relative src, target dst)."""
    out: list[Segment] = []
    i = j = 0
    while i < len(target) and j < len(piece):
        tg, tl, tloc = (int(x) for x in target[i])
        pg, pl, ploc = (int(x) for x in piece[j])
        lo, hi = max(tg, pg), min(tg + tl, pg + pl)
        if hi > lo:
            out.append(Segment((ploc + lo - pg) * isz, (tloc + lo - tg) * isz, (hi - lo) * isz))
        if tg + tl <= pg + pl:
            i += 1
        else:
            j += 1
    return out
