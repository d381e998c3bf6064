"""Reading the commonest tensor entries of a one-document manifest all together.

Most entries hold one piece (a tensor saved by one rank, or replicated) or a few (split over a
few ranks), in JSON arrays of plain integers. Read one at a time, each entry cost 8 to 21 us
(one-piece to two-piece), most of a load of a thousand small tensors. Here each entry is only
unpacked into a row of integers in plain Python; the rows of entries with as many pieces and
dimensions are checked together against the rules of docs/format.md §8, one numpy call per rule,
and the entries handed out as views of their group's arrays. An entry that is not plain, or
breaks a rule, is left out: the general reader (``TensorEntry.from_json``) reads it and names
what is wrong.
The tables of a version 3 or 4 manifest (format/table.py) are checked by the same rules
(``valid_entries``).
"""
from __future__ import annotations

import itertools
import math
from typing import Callable

import numpy as np

from .columns import INT64_MAX, UINT64_MAX, shape_problem
from .dtypes import NAME_TO_DTYPE

FEW_PIECES = 8  # entries with more pieces are left to the general reader
BOX, FLAT = "box", "flat"
_INT = {int}  # the one type a plain JSON value may have


class _Group:
    """The unpacked entries of one (pieces, dimensions) shape, in the manifest's order."""

    def __init__(self):
        self.names, self.heads, self.rows, self.sums = [], [], [], []


def read_plain_entries(docs: dict, files: list[str], file_sizes: np.ndarray, block_bytes: int,
                       world_size: int, make: Callable) -> dict:
    """fqn -> entry (made by ``make``: ``valid_entries``) of each entry of ``docs`` that is plain
    and valid; the rest are absent."""
    groups: dict[tuple[int, int], _Group] = {}
    most = min(FEW_PIECES, world_size)
    for fqn, data in docs.items():
        unpacked = _unpacked(data, most)
        if unpacked is not None:
            key, head, row, sums = unpacked
            group = groups.get(key) or groups.setdefault(key, _Group())
            group.names.append(fqn)
            group.heads.append(head)
            group.rows.append(row)
            group.sums.append(sums)
    out = {}
    for (n, dims), group in groups.items():
        matrix, kept = _matrix(group.rows)
        sums = [group.sums[i] for i in kept]
        out.update(valid_entries(matrix, [group.names[i] for i in kept], [group.heads[i] for i in kept],
                                 np.array([*itertools.chain(*sums)], dtype=np.uint64),
                                 [*itertools.accumulate(map(len, sums), initial=0)], n, dims, files, file_sizes,
                                 block_bytes, make))
    return out


def valid_entries(matrix: np.ndarray, names: list, heads: list, flat: np.ndarray, ends: list[int], n: int, dims: int,
                  files: list[str], file_sizes: np.ndarray, block_bytes: int, make: Callable) -> dict:
    """``make(rows, names, heads, valid)``: fqn -> entry of each row of ``matrix`` (entries of
    ``n`` pieces of ``dims`` dimensions, laid out as ``_unpacked`` makes a row) that keeps every
    rule (``valid``), ``rows`` the ``EntryRows`` of them all; row i's checksums are
    ``flat[ends[i]:ends[i + 1]]``."""
    valid = _valid(matrix, n, dims, len(files), file_sizes, block_bytes).tolist()
    return make(EntryRows(matrix, n, dims, flat, ends, [head[2] for head in heads]), names, heads, valid)


class EntryRows:
    """The arrays of entries read together (as many pieces and dimensions each), as columns of
    one row per entry. Each entry's own arrays are views of a row, made only when asked for
    (``TensorEntry.in_rows``): a load of a thousand small tensors reads the columns of all of
    them at once (engine/whole_pieces.py), where making seven views of each took longer than the
    reads."""

    def __init__(self, matrix: np.ndarray, n: int, dims: int, flat: np.ndarray, ends: list[int], layouts: list[str]):
        self.file, self.offset, self.nbytes, self.start, self.size, counts, limit, _ = _columns(matrix, n, dims)
        self.bounds = np.zeros((len(matrix), n + 1), dtype=np.int64)
        np.cumsum(counts, axis=1, out=self.bounds[:, 1:])
        self.flat, self.ends = flat, np.asarray(ends, dtype=np.int64)
        # stored whole in one box piece (TensorEntry.whole_in_one_piece), asked of every entry a load reads
        whole = (self.size[:, 0, :] == limit).all(axis=1) if n == 1 else np.zeros(len(matrix), dtype=bool)
        self.whole = [w and layout == BOX for w, layout in zip(whole.tolist(), layouts)]
        self.in_whole = [None] * len(matrix) if n == 1 or not dims else self._rows_apart(limit, layouts, matrix[:, -1])

    def _rows_apart(self, shape: np.ndarray, layouts: list[str], itemsize: np.ndarray) -> list:
        """Per entry, where each piece lands in the whole tensor, in bytes, if the pieces are runs
        of whole rows that together cover it (``plan.load_plan.piece_offsets``), else None."""
        runs = ((self.size[:, :, 1:] == shape[:, None, 1:]).all(axis=(1, 2))
                & (self.size[:, :, 0].sum(axis=1) == shape[:, 0]))
        at = (self.start[:, :, 0] * (shape[:, 1:].prod(axis=1) * itemsize)[:, None]).tolist()
        return [offsets if ok and layout == BOX else None for offsets, ok, layout in zip(at, runs.tolist(), layouts)]

    def arrays_of(self, i: int) -> dict[str, np.ndarray]:
        """Entry ``i``'s arrays, by ``TensorEntry``'s field names."""
        return {"file": self.file[i], "offset": self.offset[i], "nbytes": self.nbytes[i], "start": self.start[i],
                "size": self.size[i], "checksum": self.flat[self.ends[i]:self.ends[i + 1]],
                "checksum_bounds": self.bounds[i]}

    def first_checksums(self, rows: np.ndarray) -> np.ndarray:
        """The checksum of each piece's first block, of the entries ``rows`` (entries x pieces)."""
        return self.flat[self.ends[rows][:, None] + self.bounds[rows, :-1]]


def _unpacked(data, most: int) -> tuple | None:
    """((pieces, dims), (dtype, shape, layout), row, flat checksums) of a plain entry of at most
    ``most`` pieces, or None. The row holds, back to back: file, offset, nbytes (one per piece),
    start, size (pieces x dims), checksum counts (one per piece), the limit of each dimension
    (the shape; a flat entry's one: its element count) and the item size. (Each check is one
    plain comparison where it can be: this runs for every entry of the manifest.)"""
    if type(data) is not dict or "checksum_blocks" in data:
        return None
    try:
        dtype, shape, layout = NAME_TO_DTYPE[data["dtype"]], data["shape"], data["layout"]
        file, offset, nbytes, start, size, sums = (data["file"], data["offset"], data["nbytes"], data["start"],
                                                   data["size"], data["checksum"])
    except (KeyError, TypeError):  # (an unhashable dtype name)
        return None
    if (type(shape) is not list or type(file) is not list or type(offset) is not list or type(nbytes) is not list
            or type(start) is not list or type(size) is not list or type(sums) is not list):
        return None
    n = len(file)
    if not 0 < n <= most or len(offset) != n or len(nbytes) != n or len(start) != n or len(size) != n or len(sums) != n:
        return None
    if layout not in (BOX, FLAT):
        return None
    dims = len(shape) if layout == BOX else 1
    if n == 1:  # the commonest: a tensor saved by one rank, or replicated
        box_start, box_size, piece_sums = start[0], size[0], sums[0]
        if type(box_start) is not list or type(box_size) is not list or len(box_start) != dims or len(box_size) != dims:
            return None
        flat_sums = piece_sums if type(piece_sums) is list else [piece_sums]
        head = [file[0], offset[0], nbytes[0], *box_start, *box_size, len(flat_sums)]
    else:
        head = [*file, *offset, *nbytes]
        for box in itertools.chain(start, size):
            if type(box) is not list or len(box) != dims:
                return None
            head += box
        flat_sums = []
        for piece_sums in sums:
            if type(piece_sums) is list:
                flat_sums += piece_sums
                head.append(len(piece_sums))
            else:
                flat_sums.append(piece_sums)
                head.append(1)
    if {*map(type, shape)} - _INT or (shape and (min(shape) < 0 or max(shape) > INT64_MAX)):
        return None
    if shape_problem(shape, dtype.itemsize):
        return None
    row = [*head, *(shape if layout == BOX else (math.prod(shape),)), dtype.itemsize]
    if ({*map(type, row)} != _INT or {*map(type, flat_sums)} != _INT or min(flat_sums) < 0
            or max(flat_sums) > UINT64_MAX):
        return None
    return (n, dims), (dtype, tuple(shape), layout), row, flat_sums


def _matrix(rows: list[list[int]]) -> tuple[np.ndarray, list[int]]:
    """The rows as one int64 array, and their indices: a row with a value beyond 64 bits
    (possible only in a hand-made manifest) is left out."""
    try:
        return np.array(rows, dtype=np.int64), list(range(len(rows)))
    except OverflowError:
        kept = [i for i, row in enumerate(rows) if -INT64_MAX <= min(row) and max(row) <= INT64_MAX]
        return np.array([rows[i] for i in kept], dtype=np.int64).reshape(len(kept), len(rows[0])), kept


def _columns(matrix: np.ndarray, n: int, dims: int) -> tuple[np.ndarray, ...]:
    """file, offset, nbytes (entries x pieces), start, size (entries x pieces x dims), checksum
    counts (entries x pieces), limit (entries x dims) and item size (entries) of ``matrix``."""
    k, cut = len(matrix), np.cumsum([0, n, n, n, n * dims, n * dims, n, dims, 1])
    file, offset, nbytes, start, size, counts, limit, item = (matrix[:, a:b] for a, b in zip(cut, cut[1:]))
    return file, offset, nbytes, start.reshape(k, n, dims), size.reshape(k, n, dims), counts, limit, item[:, 0]


def _valid(matrix: np.ndarray, n: int, dims: int, file_count: int, file_sizes: np.ndarray,
           block_bytes: int) -> np.ndarray:
    """Which rows keep every rule: each piece lies inside the tensor and inside its file, holds
    exactly its extent's bytes and has one checksum per block (one for no bytes), and the
    pieces cover the tensor exactly once. A value that wraps around in int64 does so only in a
    row that an earlier rule refuses (all values non-negative and each piece inside a tensor of
    fewer than 2**63 bytes before any product or sum is trusted)."""
    if not file_count:  # (no piece can be valid, and no file size be looked up)
        return np.zeros(len(matrix), dtype=bool)
    file, offset, nbytes, start, size, counts, limit, item = _columns(matrix, n, dims)
    ok = ((file >= 0) & (file < file_count) & (offset >= 0)).all(axis=1)
    ok &= ((start >= 0) & (size >= 0) & (size <= limit[:, None, :] - start)).all(axis=(1, 2))
    elems = size.prod(axis=2)
    ok &= (nbytes == elems * item[:, None]).all(axis=1)
    ok &= (nbytes <= file_sizes[np.where(ok[:, None], file, 0)] - offset).all(axis=1)
    ok &= (counts == np.maximum(1, -(-nbytes // block_bytes))).all(axis=1)
    # Tiling: no two pieces share an element and together they hold as many as the tensor. (Two
    # boxes share one where they overlap in every dimension; an empty one shares none.)
    end = start + size
    shared = (np.maximum(start[:, :, None], start[:, None]) < np.minimum(end[:, :, None], end[:, None])).all(axis=3)
    shared &= ~np.eye(n, dtype=bool)
    total = limit.prod(axis=1)
    return ok & ((total == 0) | (~shared.any(axis=(1, 2)) & (elems.sum(axis=1) == total)))
