"""The tables of a version 3 or 4 manifest: tensors of one piece or a few, column by column.

Most tensors of a checkpoint are stored whole in one piece (saved by one rank, or replicated),
or in a few pieces (split over the few ranks that saved it). Written as JSON objects
(docs/format.md §3), each took about 170 bytes or more, and longer to parse than all its checks
(format/plain_entries.py): a third of a load of a thousand small tensors. In a table each is a
row of plain values, one per column. A row of ``table`` (one whole piece: name, dtype, shape,
file, offset, checksum) stands for the entry ``{"dtype", "shape", "layout": "box", "file":
[file], "offset": [offset], "nbytes": [prod(shape) * itemsize], "start": [[0, ...]], "size":
[shape], "checksum": [checksum]}``; a row of ``pieces`` (a few box pieces) for the entry of its
pieces' files, offsets, starts, sizes and checksums, each piece's ``nbytes`` its box's elements
times the itemsize. Each keeps the rules of the entry it stands for. A table whose every value
is plain is checked with numpy, all at once; any other is read entry by entry by the general
reader, which names what is wrong.

Version 3 wrote a row of ``pieces`` as a list of its pieces' values in each column (a box a list
in that list). Version 4 writes its pieces' values one after another in each column, the number
of each row's pieces in the column ``pieces``: the nested lists took twice as long to parse as
the values in them (docs/format.md §3). Both are read into one ``Table``.
"""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from .columns import INT64_MAX, shape_problem
from .dtypes import NAME_TO_DTYPE, dtype_name
from .plain_entries import _INT, BOX, FEW_PIECES, valid_entries

TABLE_MIN_TENSORS = 64  # a manifest with fewer tensors of a table's kind keeps them as JSON objects
WHOLE, PIECES = "table", "pieces"  # the tables: their members in the manifest
COLUMNS = {WHOLE: ("name", "dtype", "shape", "file", "offset", "checksum"),
           PIECES: ("name", "dtype", "shape", "file", "offset", "start", "size", "checksum")}
FLAT_PIECES = ("name", "dtype", "shape", "pieces", "file", "offset", "start", "size", "checksum")
FLAT_PIECES_VERSION = 4  # the first version that writes ``pieces`` flat (``FLAT_PIECES``)
_SAFE_PRODUCT = 2.0 ** 62  # products below it, computed in float64, are exact enough to trust in int64


def tables_json(entries: dict) -> dict[str, dict]:
    """member -> columns of each table that holds at least ``TABLE_MIN_TENSORS`` of the entries
    (a manifest of a few tensors stays version 1: older statesnap reads it, and a person reads
    its entries). ``pieces`` is written flat, as version 4 reads it."""
    whole, pieces = {}, {}
    for fqn, entry in entries.items():
        if entry.whole_in_one_piece:
            whole[fqn] = entry
        elif entry.layout == BOX and 1 < len(entry.file) <= FEW_PIECES:
            pieces[fqn] = entry
    out = {}
    if len(whole) >= TABLE_MIN_TENSORS:
        out[WHOLE] = {**_heads(whole), "file": [int(e.file[0]) for e in whole.values()],
                      "offset": [int(e.offset[0]) for e in whole.values()],
                      "checksum": [e.checksums_json()[0] for e in whole.values()]}
    if len(pieces) >= TABLE_MIN_TENSORS:
        def each_piece(values: Callable) -> list:
            return [*itertools.chain.from_iterable(map(values, pieces.values()))]

        out[PIECES] = {**_heads(pieces), "pieces": [len(e.file) for e in pieces.values()],
                       "file": each_piece(lambda e: e.file.tolist()), "offset": each_piece(lambda e: e.offset.tolist()),
                       "start": each_piece(lambda e: e.start.reshape(-1).tolist()),
                       "size": each_piece(lambda e: e.size.reshape(-1).tolist()),
                       "checksum": each_piece(lambda e: e.checksums_json())}
    return out


def _heads(entries: dict) -> dict:
    return {"name": list(entries), "dtype": [dtype_name(e.dtype) for e in entries.values()],
            "shape": [list(e.shape) for e in entries.values()]}


@dataclass
class Table:
    """A table as read, in either layout: its rows' names, dtypes and shapes, and each piece's
    values one after another (a box's, dimension after dimension)."""

    names: list
    dtypes: list
    shapes: list
    counts: list | None  # the pieces of each row; None for ``table`` (one each)
    file: list
    offset: list
    start: list | None  # None for ``table`` (the whole tensor), and where not ``aligned``
    size: list | None
    sums: list  # each piece's checksum, or list of its blocks' checksums
    written: Callable[[], Iterable[tuple]]  # each row as a version 3 row of ``pieces``, but its name
    aligned: bool = True  # False: a version 3 row whose lists are not all as long as its pieces


def parse_table(table, member: str, version: int) -> Table:
    """The table ``member`` of a manifest of ``version``; a ValueError or TypeError where it is
    none (its values are checked when it is read: ``read_table``)."""
    if type(table) is not dict:
        raise TypeError("a JSON object of columns is expected")
    flat = member == PIECES and version >= FLAT_PIECES_VERSION
    layout = FLAT_PIECES if flat else COLUMNS[member]
    if table.keys() != set(layout):
        raise ValueError(f"its columns {sorted(table)} are not the table's {list(layout)}")
    columns = [table[name] for name in layout]
    not_list = next((name for name, column in zip(layout, columns) if type(column) is not list), None)
    if not_list is not None:
        raise TypeError(f"its column {not_list!r} is not a list")
    if len({*map(len, columns[:4] if flat else columns)}) != 1:
        raise ValueError("its columns of one value per row must all be of one length" if flat else
                         "its columns must all be of one length")
    names = columns[0]
    if {*map(type, names)} - {str}:
        raise TypeError("the names must be strings")
    if len(set(names)) != len(names):
        seen = set()
        twice = next(name for name in names if name in seen or seen.add(name))
        raise ValueError(f"the tensor {twice!r} has two rows")
    if member == WHOLE:
        dtypes, shapes, file, offset, sums = columns[1:]
        return Table(names, dtypes, shapes, None, file, offset, None, None, sums,
                     lambda: (_as_pieces(*row) for row in zip(*columns[1:])))
    return _flat_pieces(names, *columns[1:]) if flat else _nested_pieces(names, *columns[1:])


def _as_pieces(dtype, shape, file, offset, sums) -> tuple:
    """A row of ``table`` as a row of ``pieces``: one piece, its box (None) the whole tensor."""
    return dtype, shape, [file], [offset], None, None, [sums]


def _nested_pieces(names, dtypes, shapes, file, offset, start, size, sums) -> Table:
    """Version 3's ``pieces``: a list of its pieces' values in each cell of a row (a list of
    boxes in ``start`` and ``size``), flattened where every row's lists are as long as its pieces."""
    if {*itertools.chain.from_iterable(map(type, cells) for cells in (file, offset, start, size, sums))} - {list}:
        raise TypeError("a row of pieces holds a list of its pieces' values in each column but name, dtype and shape")
    counts = [*map(len, file)]
    boxes = [[*itertools.chain.from_iterable(cells)] for cells in (start, size)]
    dims = [*itertools.chain.from_iterable(itertools.repeat(len(s) if type(s) is list else -1, n)
                                           for s, n in zip(shapes, counts))]
    aligned = (all([*map(len, cells)] == counts for cells in (offset, start, size, sums))
               and all([len(box) if type(box) is list else -2 for box in cells] == dims for cells in boxes))
    return Table(names, dtypes, shapes, counts, [*itertools.chain(*file)], [*itertools.chain(*offset)],
                 *([*itertools.chain.from_iterable(cells)] if aligned else None for cells in boxes),
                 [*itertools.chain(*sums)], lambda: zip(dtypes, shapes, file, offset, start, size, sums), aligned)


def _flat_pieces(names, dtypes, shapes, counts, file, offset, start, size, sums) -> Table:
    """Version 4's ``pieces``: each piece's values one after another, ``counts`` of them a row.
    Where the counts and the columns do not add up, no row can be told from the next: the table
    is refused."""
    if {*map(type, counts)} - _INT or min(counts, default=0) < 0 or {*map(type, shapes)} - {list}:
        bad = next(i for i, (n, shape) in enumerate(zip(counts, shapes))
                   if type(n) is not int or n < 0 or type(shape) is not list)
        raise ValueError(f"the row of tensor {names[bad]!r} needs a count of pieces (an integer, not negative) "
                         "and a shape (a list)")
    pieces, coordinates = sum(counts), sum(map(operator.mul, counts, map(len, shapes)))
    if not len(file) == len(offset) == len(sums) == pieces:
        raise ValueError(f"its rows count {pieces} pieces, but its columns 'file', 'offset' and 'checksum' hold "
                         f"{len(file)}, {len(offset)} and {len(sums)} values")
    if not len(start) == len(size) == coordinates:
        raise ValueError(f"its rows' pieces have {coordinates} dimensions in all, but its columns 'start' and "
                         f"'size' hold {len(start)} and {len(size)} values")
    return Table(names, dtypes, shapes, counts, file, offset, start, size, sums,
                 lambda: _flat_rows(dtypes, shapes, counts, file, offset, start, size, sums))


def _flat_rows(dtypes, shapes, counts, file, offset, start, size, sums) -> Iterable[tuple]:
    """Each row of a version 4 ``pieces`` as version 3 writes it, but its name."""
    piece = coordinate = 0
    for dtype, shape, n in zip(dtypes, shapes, counts):
        dims, end = len(shape), piece + n
        boxes = ([values[coordinate + k * dims:coordinate + (k + 1) * dims] for k in range(n)]
                 for values in (start, size))  # (a 0-d tensor's boxes are empty)
        yield dtype, shape, file[piece:end], offset[piece:end], *boxes, sums[piece:end]
        piece, coordinate = end, coordinate + n * dims


def read_table(table: Table, files: list[str], file_sizes: np.ndarray, block_bytes: int, world_size: int,
               make: Callable, general: Callable[[str, dict], object]) -> dict:
    """fqn -> entry of each row of ``table``: made by ``make`` as plain_entries makes them where
    every row is plain and valid, else by ``general(fqn, entry)`` from the JSON entry each row
    stands for (``TensorEntry.from_json``, which names what is wrong)."""
    out = _all_together(table, files, file_sizes, block_bytes, min(FEW_PIECES, world_size), make)
    if out is not None:
        return out
    return {fqn: general(fqn, _row_entry(*row)) for fqn, row in zip(table.names, table.written())}


def _all_together(table: Table, files: list[str], file_sizes: np.ndarray, block_bytes: int, most: int,
                  make: Callable) -> dict | None:
    """The entries of ``table``, checked with numpy, one call per rule for all rows of as many
    pieces and dimensions; None where a value is not plain, a row has more than ``most`` pieces
    (the general reader caps them at the world size, and checks many without pairing them all)
    or a row breaks a rule."""
    names, shapes, counts = table.names, table.shapes, table.counts
    if not names:
        return {}
    if not table.aligned:
        return None
    try:
        dtypes = [NAME_TO_DTYPE[name] for name in table.dtypes]
    except (KeyError, TypeError):  # (TypeError: an unhashable name)
        return None
    ints = [table.file, table.offset] + ([] if counts is None else [table.start, table.size])
    if {*map(type, shapes)} != {list} or {*map(type, itertools.chain(*shapes, *ints))} - _INT:
        return None
    if counts is not None and not 1 <= min(counts) <= max(counts) <= most:
        return None
    per_piece = [1 if type(s) is int else len(s) if type(s) is list else 0 for s in table.sums]
    if min(per_piece) < 1:  # (a value neither an integer nor a list, or an empty list)
        return None
    flat = table.sums if max(per_piece) == 1 else [
        *itertools.chain.from_iterable([s] if type(s) is int else s for s in table.sums)]
    if {*map(type, flat)} - _INT or min(flat) < 0:  # (numpy 1 wraps a negative into uint64)
        return None
    try:  # (OverflowError: a value past 64 bits)
        sums = np.array(flat, np.uint64)
        columns = [np.array(values, np.int64) for values in ints]
    except OverflowError:
        return None
    pieces_of = [1] * len(names) if counts is None else counts
    dims_of = [*map(len, shapes)]
    first_piece = np.array([*itertools.accumulate(pieces_of, initial=0)], np.int64)
    first_coordinate = np.array([*itertools.accumulate(map(operator.mul, pieces_of, dims_of), initial=0)], np.int64)
    sums_before = np.array([*itertools.accumulate(per_piece, initial=0)], np.int64)
    sums_per_piece = np.asarray(per_piece, np.int64)
    out = {}
    for (n, dims), rows_of in _groups(pieces_of, dims_of).items():
        at = np.asarray(rows_of, np.int64)
        pieces = first_piece[at, None] + np.arange(n)
        matrix = _matrix(rows_of, n, dims, dtypes, shapes, columns, pieces,
                         None if counts is None else first_coordinate[at, None] + np.arange(n * dims),
                         sums_per_piece[pieces])
        if matrix is None:
            return None
        entries = valid_entries(matrix, _pick(names, rows_of),
                                [(dtypes[i], tuple(shapes[i]), BOX) for i in rows_of], *_checksums_of(
                                    pieces, sums, sums_before, len(sums_per_piece)), n, dims,
                                files, file_sizes, block_bytes, make)
        if len(entries) != len(rows_of):
            return None
        out.update(entries)
    return {fqn: out[fqn] for fqn in names}  # (in the table's order)


def _groups(pieces_of: list[int], dims_of: list[int]) -> dict[tuple[int, int], range | list[int]]:
    """The rows by their (pieces, dimensions): ``range(rows)`` where all are alike (the commonest)."""
    pieces, dims = {*pieces_of}, {*dims_of}
    if len(pieces) == len(dims) == 1:
        return {(pieces.pop(), dims.pop()): range(len(dims_of))}
    groups: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(zip(pieces_of, dims_of)):
        groups.setdefault(key, []).append(i)
    return groups


def _pick(column: list | tuple, rows_of: range | list[int]) -> list | tuple:
    """The values of ``column`` at ``rows_of`` (``_groups``' rows)."""
    return column[:len(rows_of)] if type(rows_of) is range else [column[i] for i in rows_of]


def _checksums_of(pieces: np.ndarray, sums: np.ndarray, sums_before: np.ndarray,
                  piece_count: int) -> tuple[np.ndarray, list[int]]:
    """The checksums of the rows whose pieces are ``pieces`` (rows x pieces) back to back, and
    where each row's begin (``valid_entries``' ``flat`` and ``ends``)."""
    k, n = pieces.shape
    if len(sums) == piece_count:  # one checksum per piece (the commonest): at once
        return sums[pieces.reshape(-1)], list(range(0, k * n + 1, n))
    own = [np.arange(sums_before[first], sums_before[first + n]) for first in pieces[:, 0].tolist()]
    return sums[np.concatenate(own)], [*itertools.accumulate(map(len, own), initial=0)]


def _matrix(rows_of: range | list[int], n: int, dims: int, dtypes: list, shapes: list, columns: list[np.ndarray],
            pieces: np.ndarray, coordinates: np.ndarray | None, per_piece: np.ndarray) -> np.ndarray | None:
    """The rows ``rows_of`` (tensors of ``n`` pieces of ``dims`` dimensions; ``pieces`` and
    ``coordinates``: where their values are in the ``columns`` file, offset, start and size) laid
    out as plain_entries lays out an entry: file, offset, nbytes, start, size, checksum counts
    (``per_piece``), shape, item size. None where a shape has a value past 64 bits or is too
    large for a tensor (``shape_problem``)."""
    k = len(rows_of)
    try:
        shape = _stacked(_pick(shapes, rows_of), dims)
    except OverflowError:
        return None
    if dims and (shape < 0).any():
        return None
    file, offset = columns[0][pieces], columns[1][pieces]
    if coordinates is None:
        lo, extent = np.zeros((k, n, dims), np.int64), shape[:, None, :]
    else:
        lo, extent = (values[coordinates].reshape(k, n, dims) for values in columns[2:])
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
    nbytes = extent.prod(axis=2) * isz[:, None] if coordinates is not None else (shape.prod(axis=1) * isz)[:, None]
    extent = np.broadcast_to(extent, (k, n, dims))
    return np.column_stack([file, offset, nbytes, lo.reshape(k, n * dims), extent.reshape(k, n * dims), per_piece,
                            shape, isz])


def _stacked(cells: list, width: int) -> np.ndarray:
    """``cells`` (lists of ``width`` integers) as an int64 array of a row per cell. Made from
    one flat list: numpy converts that several times faster than the nested lists."""
    return np.array([*itertools.chain.from_iterable(cells)], np.int64).reshape(len(cells), width)


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
