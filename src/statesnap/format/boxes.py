"""Exact box arithmetic: do a tensor's pieces tile it, each element in exactly one piece?

The format promises that a tensor's pieces never overlap and together cover it (docs/format.md
§4), and both the save planner and the manifest parser enforce it here. Counting elements cannot:
rows 0-5 and rows 4-9 of a 12-row tensor add up to 12 rows while rows 10-11 are in no piece, and
a load would leave them stale without a word. Comparing every pair of pieces is exact but
O(pieces²), too slow for the thousands of pieces per tensor a large job writes. So the check
works on the *compressed grid*: the pieces' cut points along each dimension split the tensor into
cells, every piece covers whole cells, and the pieces tile the tensor exactly when every cell is
covered exactly once. Three vectorised ways to decide that, cheapest first:

* Dimensions every piece spans whole are dropped. When one dimension is left (flat ranges, FSDP
  and column-parallel TP shards, which both cut dimension 0) the pieces sorted by start must
  chain, each ending where the next begins: a sort and a comparison.
* When the cells are few (a product grid of cuts, such as TP x FSDP boxes), each piece is mapped
  to the cells it spans and one ``bincount`` counts how often each cell is covered.
* Otherwise corners decide. The indicator of an interval ``[a, b)`` is the running sum of +1 at
  ``a`` and -1 at ``b``; a d-dimensional box's indicator is the running sum, along every axis, of
  ±1 at its 2^d corners (one minus sign per upper bound). Running sums can be undone, so the
  pieces cover every cell exactly once if and only if their signed corners, added up point by
  point, equal those of the whole tensor. At the first point (in lexicographic order) where the
  two differ, the coverage itself differs from one: the running sum there adds up points below it
  in every coordinate, all lexicographically earlier, where the two agree. So one sort of the
  corners decides and also finds a cell covered twice or never. This costs 2^d corners per piece
  in the d dimensions that are cut; beyond ``MAX_CORNERS`` a layout is refused as too irregular
  to check, which only a hand-made manifest reaches.

Pieces with no elements (ranks that hold nothing of an unevenly sharded tensor) take no room and
are ignored. Callers check first that every piece lies inside the tensor (``first_outside``) and
that the tensor's element count fits in 63 bits, so no product or sum here can overflow.
"""
from __future__ import annotations

import math
import operator
from typing import Callable, Sequence

import numpy as np

MIN_CELLS = 1 << 16  # a grid this small is counted cell by cell whatever the piece count
CELLS_PER_PIECE = 8  # ... and a larger one only up to this many cells per piece
MAX_CORNERS = 1 << 22  # corner rows (pieces x 2^cut dimensions) the general check may sort


def first_outside(start: np.ndarray, size: np.ndarray, limit: Sequence[int]) -> int:
    """Index of the first row whose box ``[start, start + size)`` is not inside ``[0, limit)``,
    or -1. Compares ``size`` with ``limit - start`` so that no sum can overflow int64."""
    bad = (start < 0) | (size < 0) | (size > np.asarray(limit, dtype=np.int64) - start)  # also start > limit
    return int(np.argmax(bad.any(axis=1))) if bad.any() else -1


def region(lo: Sequence[int], hi: Sequence[int]) -> str:
    """A box in slice notation, ``[0:6, 0:4]``, as errors show it."""
    return "[" + ", ".join(f"{int(a)}:{int(b)}" for a, b in zip(lo, hi)) + "]"


def few_boxes_tile(shape: Sequence[int], start: list[list[int]], size: list[list[int]]) -> bool:
    """Whether a few boxes, each already inside ``shape`` (plain integers), cover it exactly
    once: their elements add up to the shape's and no two that hold any overlap. Pairwise, so
    for a handful of pieces only; ``tiling_problem`` decides the rest and says what is wrong."""
    total = math.prod(shape)
    if total == 0:
        return True  # an empty tensor: every piece inside it is empty too
    counts = [*map(math.prod, size)]
    if sum(counts) != total:
        return False
    # (map over operators: generators per pair cost half as much again, measured)
    held = [(lo, [*map(operator.add, lo, extent)]) for lo, extent, count in zip(start, size, counts) if count]
    for k, (lo1, hi1) in enumerate(held):
        for lo2, hi2 in held[k + 1:]:
            if all(map(operator.lt, map(max, lo1, lo2), map(min, hi1, hi2))):
                return False
    return True


def tiling_problem(shape: Sequence[int], start: np.ndarray, size: np.ndarray,
                   describe: Callable[[int], str]) -> str | None:
    """None if the boxes (one row of ``start``/``size`` per piece, all inside ``shape``) cover
    every element of ``shape`` exactly once; else a sentence naming two overlapping pieces
    (``describe(i)`` names piece ``i``) and their common region, or a region no piece holds."""
    shape = tuple(int(s) for s in shape)
    if math.prod(shape) == 0:
        return None  # an empty tensor: every piece inside it is empty too
    if len(start) == 1 and not start.any() and size[0].tolist() == list(shape):
        return None  # one piece, the whole tensor: the commonest case, decided without the rest
    # column by column: numpy reduces a (pieces, 2) array along its short axis several times slower
    nonempty = np.ones(len(start), dtype=bool)
    for d in range(len(shape)):
        nonempty &= size[:, d] > 0
    keep = np.flatnonzero(nonempty)
    lo, hi = (start, start + size) if len(keep) == len(start) else (start[keep], start[keep] + size[keep])
    cut = [d for d in range(len(shape)) if lo[:, d].any() or (hi[:, d] != shape[d]).any()]  # lo >= 0

    def overlap(i: int, j: int) -> str:
        a, b = np.maximum(lo[i], lo[j]), np.minimum(hi[i], hi[j])
        return f"{describe(int(keep[i]))} and {describe(int(keep[j]))} overlap in {region(a, b)}"

    def hole(a: Sequence[int], b: Sequence[int]) -> str:
        lo_full, hi_full = [0] * len(shape), list(shape)
        for d, x, y in zip(cut, a, b):
            lo_full[d], hi_full[d] = x, y
        return f"{region(lo_full, hi_full)} is in no piece"

    if len(cut) == 0:  # every piece is the whole tensor
        return None if len(keep) == 1 else overlap(0, 1) if len(keep) else hole((), ())
    if len(cut) == 1:
        return _chain(lo[:, cut[0]], hi[:, cut[0]], shape[cut[0]], overlap, hole)
    return _grid(lo[:, cut], hi[:, cut], [shape[d] for d in cut], overlap, hole)


def _chain(lo: np.ndarray, hi: np.ndarray, end: int, overlap, hole) -> str | None:
    """Intervals in ``[0, end)``: sorted by start, each must end where the next begins. If two
    intervals overlap, two neighbours in that order do, so comparing neighbours is exact."""
    order = np.argsort(lo, kind="stable")
    a, b = lo[order], hi[order]
    over = np.flatnonzero(b[:-1] > a[1:])
    if len(over):
        return overlap(order[over[0]], order[over[0] + 1])
    ends, starts = np.concatenate([[0], b]), np.concatenate([a, [end]])
    gap = np.flatnonzero(ends != starts)  # no overlap: ends <= starts, so these are holes
    return hole((ends[gap[0]],), (starts[gap[0]],)) if len(gap) else None


def _grid(lo: np.ndarray, hi: np.ndarray, limit: list[int], overlap, hole) -> str | None:
    """Boxes cut along several dimensions: count cells when they are few, else compare corners.
    Columns are kept as separate 1-D arrays, for the same reason as in ``tiling_problem``."""
    dims = range(len(limit))
    cuts = [_distinct(np.concatenate([[0, limit[d]], lo[:, d], hi[:, d]])) for d in dims]
    ilo = [np.searchsorted(cuts[d], lo[:, d]) for d in dims]  # each piece's cells, per dimension
    ihi = [np.searchsorted(cuts[d], hi[:, d]) for d in dims]
    cells = [len(c) - 1 for c in cuts]
    budget = max(MIN_CELLS, CELLS_PER_PIECE * len(lo))

    def cell_region(at: Sequence[int]) -> tuple[list, list]:
        return [int(c[i]) for c, i in zip(cuts, at)], [int(c[i + 1]) for c, i in zip(cuts, at)]

    if math.prod(cells) <= budget:
        span = [b - a for a, b in zip(ilo, ihi)]
        per_piece = math.prod(span)  # cells per piece, each at most the cell count: no overflow
        if int(per_piece.sum()) <= budget:
            return _count_cells(ilo, span, per_piece, cells, cell_region, overlap, hole)
    return _corners(np.stack(ilo, axis=1), np.stack(ihi, axis=1), cells, cell_region, overlap, hole)


def _distinct(values: np.ndarray) -> np.ndarray:
    """Sorted distinct values: ``np.unique``, several times faster on a few thousand integers."""
    values = np.sort(values)
    return values[np.concatenate([[True], values[1:] != values[:-1]])]


def _count_cells(ilo, span, per_piece, cells, cell_region, overlap, hole) -> str | None:
    """Expand every piece into the (row-major) ids of the cells it spans and count each cell."""
    strides = [math.prod(cells[d + 1:]) for d in range(len(cells))]
    if len(per_piece) == int(per_piece.sum()):  # one cell each, as in a product grid: no expansion
        rows, ids = np.arange(len(per_piece)), sum(a * s for a, s in zip(ilo, strides))
    else:
        rows = np.repeat(np.arange(len(per_piece)), per_piece)
        rest = np.arange(len(rows)) - np.repeat(np.cumsum(per_piece) - per_piece, per_piece)
        ids = np.zeros(len(rows), dtype=np.int64)
        for d in range(len(cells) - 1, -1, -1):
            rest, within = np.divmod(rest, span[d][rows])
            ids += (ilo[d][rows] + within) * strides[d]
    counts = np.bincount(ids, minlength=math.prod(cells))
    bad = np.flatnonzero(counts != 1)
    if not len(bad):
        return None
    if counts[bad[0]] == 0:
        return hole(*cell_region(np.unravel_index(bad[0], cells)))
    both = rows[ids == bad[0]]
    return overlap(both[0], both[1])


def _corners(ilo, ihi, cells, cell_region, overlap, hole) -> str | None:
    """Signed corners of the pieces against those of the whole grid (see the module docstring)."""
    pieces, dims = ilo.shape
    if (pieces + 1) << dims > MAX_CORNERS:
        return (f"its {pieces} pieces are cut irregularly along {dims} dimensions, too many corners to "
                "check that they neither overlap nor leave a hole")
    upper = (np.arange(1 << dims)[:, None] >> np.arange(dims) & 1).astype(bool)  # (2^dims, dims)
    sign = np.where(upper.sum(axis=1) % 2, -1, 1)
    points = np.concatenate([np.where(upper, ihi[:, None, :], ilo[:, None, :]).reshape(-1, dims),
                             np.where(upper, np.asarray(cells), 0)])
    weights = np.concatenate([np.tile(sign, pieces), -sign])
    order = np.lexsort(points.T[::-1])  # lexicographic: dimension 0 first
    points, weights = points[order], weights[order]
    heads = np.flatnonzero(np.concatenate([[True], (points[1:] != points[:-1]).any(axis=1)]))
    differ = np.flatnonzero(np.add.reduceat(weights, heads))
    if not len(differ):
        return None
    at = points[heads[differ[0]]]
    inside = np.flatnonzero(((ilo <= at) & (at < ihi)).all(axis=1))  # none, or two and more
    return overlap(inside[0], inside[1]) if len(inside) else hole(*cell_region(at))
