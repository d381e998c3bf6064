"""The tables of a version 3 manifest: tensors of one piece or a few, column by column.

Most tensors of a checkpoint are stored whole in one piece (saved by one rank, or replicated),
or in a few pieces (split over the few ranks that saved it). Written as JSON objects
(docs/format.md §3), each took about 170 bytes or more, and longer to parse than all its checks
(format/plain_entries.py): a third of a load of a thousand small tensors. In a table each is a
row of plain values, one per column. A row of ``table`` (one whole piece: name, dtype, shape,
file, offset, checksum) stands for the entry ``{"dtype", "shape", "layout": "box", "file":
[file], "offset": [offset], "nbytes": [prod(shape) * itemsize], "start": [[0, ...]], "size":
[shape], "checksum": [checksum]}``; a row of ``pieces`` (a few box pieces: also start and size,
and a list of pieces in each column but name, dtype and shape) for the entry with those columns,
each piece's ``nbytes`` its box's elements times the itemsize. Each keeps the rules of the entry
it stands for. A table whose every value is plain is checked with numpy, all at once; any other
is read entry by entry by the general reader, which names what is wrong.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable

import numpy as np

from .columns import INT64_MAX, shape_problem
from .dtypes import NAME_TO_DTYPE, dtype_name
from .plain_entries import _INT, BOX, FEW_PIECES, valid_entries

TABLE_MIN_TENSORS = 64  # a manifest with fewer tensors of a table's kind keeps them as JSON objects
WHOLE, PIECES = "table", "pieces"  # the tables: their members in the manifest
COLUMNS = {WHOLE: ("name", "dtype", "shape", "file", "offset", "checksum"),
           PIECES: ("name", "dtype", "shape", "file", "offset", "start", "size", "checksum")}
_SAFE_PRODUCT = 2.0 ** 62  # products below it, computed in float64, are exact enough to trust in int64


def tables_json(entries: dict) -> dict[str, dict]:
    """member -> columns of each table that holds at least ``TABLE_MIN_TENSORS`` of the entries
    (a manifest of a few tensors stays version 1: older statesnap reads it, and a person reads
    its entries)."""
    whole, pieces = {}, {}
    for fqn, entry in entries.items():
        if entry.whole_in_one_piece:
            whole[fqn] = entry
        elif entry.layout == BOX and 1 < len(entry.file) <= FEW_PIECES:
            pieces[fqn] = entry
    out = {}
    if len(whole) >= TABLE_MIN_TENSORS:
        out[WHOLE] = _columns(whole, lambda column: column[0])
    if len(pieces) >= TABLE_MIN_TENSORS:
        out[PIECES] = _columns(pieces, lambda column: column, boxes=True)
    return out


def _columns(entries: dict, pieces: Callable, boxes: bool = False) -> dict:
    """The columns of a table of ``entries``: ``pieces(column)`` of each piece column (its one
    value, or all)."""
    out = {"name": list(entries), "dtype": [dtype_name(e.dtype) for e in entries.values()],
           "shape": [list(e.shape) for e in entries.values()],
           "file": [pieces(e.file.tolist()) for e in entries.values()],
           "offset": [pieces(e.offset.tolist()) for e in entries.values()]}
    if boxes:
        out.update(start=[e.start.tolist() for e in entries.values()], size=[e.size.tolist() for e in entries.values()])
    out["checksum"] = [pieces(e.checksums_json()) for e in entries.values()]
    return out


def table_rows(table, member: str) -> dict[str, tuple]:
    """name -> the other columns' values of each row of the table ``member``, as written; a
    ValueError or TypeError where the table is none (its values are checked when it is read)."""
    if type(table) is not dict:
        raise TypeError("a JSON object of columns is expected")
    if table.keys() != set(COLUMNS[member]):
        raise ValueError(f"its columns {sorted(table)} are not the table's {list(COLUMNS[member])}")
    columns = [table[name] for name in COLUMNS[member]]
    if {*map(type, columns)} != {list} or len({*map(len, columns)}) != 1:
        raise ValueError("every column must be a list, all of one length")
    names = columns[0]
    if {*map(type, names)} - {str}:
        raise TypeError("the names must be strings")
    if member == PIECES and {*itertools.chain.from_iterable(map(type, cells) for cells in columns[3:])} - {list}:
        raise TypeError("a row of pieces holds a list of its pieces' values in each column but name, dtype and shape")
    rows = dict(zip(names, zip(*columns[1:])))
    if len(rows) != len(names):
        seen = set()
        twice = next(name for name in names if name in seen or seen.add(name))
        raise ValueError(f"the tensor {twice!r} has two rows")
    return rows


def read_table(rows: dict[str, tuple], member: str, files: list[str], file_sizes: np.ndarray, block_bytes: int,
               world_size: int, make: Callable, general: Callable[[str, dict], object]) -> dict:
    """fqn -> entry of each row of the table ``member`` (``table_rows``): made by ``make`` as
    plain_entries makes them where every row is plain and valid, else by ``general(fqn, entry)``
    from the JSON entry each row stands for (``TensorEntry.from_json``, which names what is wrong)."""
    whole = member == WHOLE
    out = _all_together(rows, whole, files, file_sizes, block_bytes, min(FEW_PIECES, world_size), make)
    if out is not None:
        return out
    return {fqn: general(fqn, _row_entry(*(_as_pieces(*row) if whole else row))) for fqn, row in rows.items()}


def _as_pieces(dtype, shape, file, offset, sums) -> tuple:
    """A row of ``table`` as a row of ``pieces``: one piece, its box (None) the whole tensor."""
    return dtype, shape, [file], [offset], None, None, [sums]


def _all_together(rows: dict[str, tuple], whole: bool, files: list[str], file_sizes: np.ndarray, block_bytes: int,
                  most: int, make: Callable) -> dict | None:
    """The entries of ``rows`` (of ``table`` where ``whole``, else of ``pieces``), checked with
    numpy, one call per rule for all rows of as many pieces and dimensions; None where a value is
    not plain, a row has more than ``most`` pieces (the general reader caps them at the world
    size, and checks many without pairing them all) or a row breaks a rule."""
    if not rows:
        return {}
    names = list(rows)
    if whole:
        (dtype_names, shapes, file, offset, piece_sums), start, size = zip(*rows.values()), None, None
        lists, ints, sums = [shapes], [*shapes, file, offset], None
        first_piece = list(range(len(names) + 1))
    else:
        dtype_names, shapes, file, offset, start, size, sums = zip(*rows.values())
        lists, ints = [shapes, file, offset, sums, start, size], [*shapes, *file, *offset]
        piece_sums = [*itertools.chain(*sums)] if {*map(type, sums)} == {list} else None
        first_piece = [*itertools.accumulate(map(len, sums), initial=0)] if piece_sums is not None else None
    try:
        dtypes = [NAME_TO_DTYPE[name] for name in dtype_names]
    except (KeyError, TypeError):  # (TypeError: an unhashable name)
        return None
    if (piece_sums is None or {*itertools.chain.from_iterable(map(type, column) for column in lists)} != {list}
            or {*map(type, itertools.chain(*ints))} - _INT):
        return None
    if not whole and not 1 <= min(map(len, file)) <= max(map(len, file)) <= most:
        return None
    if not whole and ({*map(type, itertools.chain(*start, *size))} - {list}
                      or {*map(type, itertools.chain.from_iterable(itertools.chain(*start, *size)))} - _INT):
        return None
    counts = [1 if type(s) is int else len(s) if type(s) is list else 0 for s in piece_sums]
    if counts and min(counts) < 1:  # (a value neither an integer nor a list, or an empty list)
        return None
    flat = piece_sums if max(counts, default=1) == 1 else [
        *itertools.chain.from_iterable([s] if type(s) is int else s for s in piece_sums)]
    if {*map(type, flat)} - _INT or (flat and min(flat) < 0):  # (numpy 1 wraps a negative into uint64)
        return None
    try:  # (OverflowError: a value past 64 bits)
        flat_arr = np.array(flat, np.uint64)
    except OverflowError:
        return None
    per_piece = [*itertools.accumulate(counts, initial=0)]
    out = {}
    for (n, dims), rows_of in _groups(shapes, None if whole else file).items():
        matrix = _matrix(rows_of, n, dims, dtypes, shapes, file, offset, start, size, sums,
                         counts, first_piece)
        if matrix is None:
            return None
        checksums, ends = _checksums_of(rows_of, n, flat_arr, per_piece, first_piece)
        entries = valid_entries(matrix, _pick(names, rows_of),
                                [(dtypes[i], tuple(shapes[i]), BOX) for i in rows_of], checksums, ends, n, dims,
                                files, file_sizes, block_bytes, make)
        if len(entries) != len(rows_of):
            return None
        out.update(entries)
    return {fqn: out[fqn] for fqn in names}  # (in the table's order)


def _groups(shapes: tuple, file: tuple | None) -> dict[tuple[int, int], range | list[int]]:
    """The rows by their (pieces, dimensions): ``range(rows)`` where all are alike (the commonest).
    ``file``: each row's files, or None for rows of one piece."""
    pieces, dims = {1} if file is None else {*map(len, file)}, {*map(len, shapes)}
    if len(pieces) == len(dims) == 1:
        return {(pieces.pop(), dims.pop()): range(len(shapes))}
    groups: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(shapes):
        groups.setdefault((1 if file is None else len(file[i]), len(shape)), []).append(i)
    return groups


def _pick(column: list | tuple, rows_of: range | list[int]) -> list | tuple:
    """The values of ``column`` at ``rows_of`` (``_groups``' rows)."""
    return column[:len(rows_of)] if type(rows_of) is range else [column[i] for i in rows_of]


def _checksums_of(rows_of: range | list[int], n: int, flat: np.ndarray, per_piece: list[int],
                  first_piece: list[int]) -> tuple[np.ndarray, list[int]]:
    """The checksums of the rows ``rows_of`` (of ``n`` pieces each) back to back, and where each
    row's begin (``valid_entries``' ``flat`` and ``ends``)."""
    firsts = np.array(_pick(first_piece, rows_of), np.int64)
    if per_piece[-1] == len(per_piece) - 1:  # one checksum per piece (the commonest): at once
        return flat[(firsts[:, None] + np.arange(n)).reshape(-1)], list(range(0, len(rows_of) * n + 1, n))
    own = [np.arange(per_piece[first], per_piece[first + n]) for first in firsts.tolist()]
    return flat[np.concatenate(own)], [*itertools.accumulate(map(len, own), initial=0)]


def _matrix(rows_of: range | list[int], n: int, dims: int, dtypes: list, shapes: tuple, file: tuple, offset: tuple,
            start: tuple | None, size: tuple, sums: tuple, counts: list[int],
            first_piece: list[int]) -> np.ndarray | None:
    """The rows ``rows_of`` (tensors of ``n`` pieces of ``dims`` dimensions) laid out as
    plain_entries lays out an entry: file, offset, nbytes, start, size, checksum counts (one per
    piece), shape, item size. None where the rows' lists are not all of one length, a value is
    negative or past 64 bits, or a shape too large for a tensor (``shape_problem``)."""
    k = len(rows_of)
    try:
        shape = _stacked(_pick(shapes, rows_of), dims)
        if start is None:
            pieces = np.column_stack([np.array(_pick(column, rows_of), np.int64) for column in (file, offset)])
            lo, extent = np.zeros((k, n, dims), np.int64), shape[:, None, :]
        else:
            pieces = np.hstack([_stacked(_pick(file, rows_of), n), _stacked(_pick(offset, rows_of), n)])
            lo, extent = (_stacked([*itertools.chain.from_iterable(_of_length(_pick(boxes, rows_of), n))],
                                   dims).reshape(k, n, dims) for boxes in (start, size))
        if sums is not None:
            _of_length(_pick(sums, rows_of), n)
    except (OverflowError, ValueError):  # (ValueError: lists of several lengths)
        return None
    if dims and (shape < 0).any():
        return None
    isz = np.array([dtype.itemsize for dtype in _pick(dtypes, rows_of)], np.int64)
    # a product that may pass 2**62 is checked exactly, as the general reader checks it (one
    # past float64's range is inf, or nan times a zero extent: no warning, the strides catch it)
    with np.errstate(over="ignore", invalid="ignore"):
        strides = np.maximum(shape[:, 1:], 1).prod(axis=1, dtype=np.float64)
        total = shape.prod(axis=1, dtype=np.float64) * isz
    doubtful = np.flatnonzero((strides >= _SAFE_PRODUCT) | (total >= _SAFE_PRODUCT)).tolist()
    if any(shape_problem(shapes[rows_of[i]], int(isz[i])) for i in doubtful):
        return None
    # (an extent past its shape gives a product that may wrap: its row breaks a rule checked beside it)
    nbytes = extent.prod(axis=2) * isz[:, None] if start is not None else (shape.prod(axis=1) * isz)[:, None]
    firsts = np.array(_pick(first_piece, rows_of), np.int64)
    piece_counts = np.asarray(counts, np.int64)[firsts[:, None] + np.arange(n)]
    return np.column_stack([pieces, nbytes, lo.reshape(k, n * dims), np.broadcast_to(extent, (k, n, dims)).reshape(
        k, n * dims), piece_counts, shape, isz])


def _of_length(cells: list, width: int) -> list:
    """``cells``, each of which must be ``width`` long (a ValueError where one is not)."""
    if {*map(len, cells)} - {width}:
        raise ValueError("lists of several lengths")
    return cells


def _stacked(cells: list, width: int) -> np.ndarray:
    """``cells`` (sequences of ``width`` integers) as an int64 array of a row per cell. Made from
    one flat list: numpy converts that several times faster than the nested lists."""
    return np.array([*itertools.chain.from_iterable(_of_length(cells, width))], np.int64).reshape(len(cells), width)


def _row_entry(name, shape, file, offset, start, size, sums) -> dict:
    """The JSON entry a row stands for, as far as the row allows: a byte count is computed only
    from values the general reader accepts (it refuses the others before it looks at it)."""
    dtype = NAME_TO_DTYPE.get(name) if type(name) is str else None
    whole = start is None
    boxes = [shape] if whole else size
    plain = (dtype is not None and type(boxes) is list
             and all(type(box) is list and all(type(s) is int and 0 <= s <= INT64_MAX for s in box) for box in boxes)
             and (not whole or not shape_problem(shape, dtype.itemsize)))
    nbytes = ([math.prod(box) * dtype.itemsize for box in boxes] if plain
              else [0] * (len(file) if type(file) is list else 1))
    return {"dtype": name, "shape": shape, "layout": BOX, "file": file, "offset": offset, "nbytes": nbytes,
            "start": [[0] * len(shape) if plain else []] if whole else start, "size": boxes, "checksum": sums}
