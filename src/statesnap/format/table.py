"""The table of a version 3 manifest: the tensors stored whole in one piece, column by column.

Most tensors of a checkpoint are stored so: saved by one rank, or replicated. Written as JSON
objects (docs/format.md §3), each cost about 170 bytes and more to parse than every check of it
(format/plain_entries.py): a third of a load of a thousand small tensors. In the table each is a
row of plain values, one per column: name, dtype, shape, file, offset, checksum. A row stands for
the entry ``{"dtype", "shape", "layout": "box", "file": [file], "offset": [offset], "nbytes":
[prod(shape) * itemsize], "start": [[0, ...]], "size": [shape], "checksum": [checksum]}`` and
keeps its rules. A table whose every value is plain is checked with numpy, all at once; any other
is read entry by entry by the general reader, which names what is wrong.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable

import numpy as np

from .columns import INT64_MAX, shape_problem
from .dtypes import NAME_TO_DTYPE, dtype_name
from .plain_entries import BOX, valid_entries

TABLE_MIN_TENSORS = 64  # a manifest with fewer tensors of one whole piece keeps them as JSON objects
COLUMNS = ("name", "dtype", "shape", "file", "offset", "checksum")
_INT = {int}  # the one type a plain JSON value may have
_SAFE_PRODUCT = 2.0 ** 62  # products below it, computed in float64, are exact enough to trust in int64


def table_json(entries: dict) -> dict | None:
    """The table of the entries stored whole in one box piece, or None where there are fewer than
    ``TABLE_MIN_TENSORS`` (a manifest of a few tensors stays version 1: older statesnap reads it,
    and a person reads its entries)."""
    whole = {fqn: e for fqn, e in entries.items() if _one_whole_piece(e)}
    if len(whole) < TABLE_MIN_TENSORS:
        return None
    sums = [e.checksum.tolist() for e in whole.values()]
    return {"name": list(whole), "dtype": [dtype_name(e.dtype) for e in whole.values()],
            "shape": [list(e.shape) for e in whole.values()], "file": [int(e.file[0]) for e in whole.values()],
            "offset": [int(e.offset[0]) for e in whole.values()],
            "checksum": [s[0] if len(s) == 1 else s for s in sums]}


def _one_whole_piece(entry) -> bool:
    return (entry.layout == BOX and len(entry.file) == 1 and entry.size[0].tolist() == list(entry.shape)
            and not any(entry.start[0].tolist()))


def table_rows(table) -> dict[str, tuple]:
    """name -> (dtype, shape, file, offset, checksum) of each row, as written; a ValueError or
    TypeError where the table is none (its values are checked when the rows are read)."""
    if type(table) is not dict:
        raise TypeError("a JSON object of columns is expected")
    if table.keys() != set(COLUMNS):
        raise ValueError(f"its columns {sorted(table)} are not the table's {list(COLUMNS)}")
    columns = [table[name] for name in COLUMNS]
    if {*map(type, columns)} != {list} or len({*map(len, columns)}) != 1:
        raise ValueError("every column must be a list, all of one length")
    names = columns[0]
    if {*map(type, names)} - {str}:
        raise TypeError("the names must be strings")
    rows = dict(zip(names, zip(*columns[1:])))
    if len(rows) != len(names):
        seen = set()
        twice = next(name for name in names if name in seen or seen.add(name))
        raise ValueError(f"the tensor {twice!r} has two rows")
    return rows


def read_table(rows: dict[str, tuple], files: list[str], file_sizes: np.ndarray, block_bytes: int,
               make: Callable, general: Callable[[str, dict], object]) -> dict:
    """fqn -> entry of each row (``table_rows``): made by ``make`` as plain_entries makes them
    where every row is plain and valid, else by ``general(fqn, entry)`` from the JSON entry each
    row stands for (``TensorEntry.from_json``, which names what is wrong)."""
    out = _all_together(rows, files, file_sizes, block_bytes, make)
    if out is not None:
        return out
    return {fqn: general(fqn, _row_entry(*row)) for fqn, row in rows.items()}


def _all_together(rows: dict[str, tuple], files: list[str], file_sizes: np.ndarray, block_bytes: int,
                  make: Callable) -> dict | None:
    """The entries of ``rows`` checked with numpy, one call per rule for all rows of a number of
    dimensions; None where a value is not plain or a row breaks a rule."""
    if not rows:
        return {}
    names = list(rows)
    dtype_names, shapes, file, offset, sums = zip(*rows.values())
    try:
        dtypes = [NAME_TO_DTYPE[name] for name in dtype_names]
    except (KeyError, TypeError):  # (TypeError: an unhashable name)
        return None
    if ({*map(type, shapes)} != {list} or {*map(type, file)} != _INT or {*map(type, offset)} != _INT
            or {*map(type, itertools.chain.from_iterable(shapes))} - _INT):
        return None
    counts = [1 if type(s) is int else len(s) if type(s) is list else 0 for s in sums]
    if min(counts) < 1:  # (a value neither an integer nor a list, or an empty list)
        return None
    flat = sums if max(counts) == 1 else [*itertools.chain.from_iterable([s] if type(s) is int else s for s in sums)]
    if {*map(type, flat)} != _INT:
        return None
    try:  # (OverflowError: a value past 64 bits, negative for the checksums)
        file_arr, offset_arr = np.array(file, np.int64), np.array(offset, np.int64)
        flat_arr = np.array(flat, np.uint64)
    except OverflowError:
        return None
    ends = [*itertools.accumulate(counts, initial=0)]
    item = np.array([d.itemsize for d in dtypes], np.int64)
    by_dims: dict[int, list[int]] = {}
    for i, shape in enumerate(shapes):
        by_dims.setdefault(len(shape), []).append(i)
    out = {}
    for dims, rows_of in by_dims.items():
        matrix = _matrix(rows_of, shapes, dims, file_arr, offset_arr, counts, item)
        if matrix is None:
            return None
        checksums = flat_arr[rows_of] if len(flat) == len(sums) else flat_arr[np.concatenate(
            [np.arange(ends[i], ends[i + 1]) for i in rows_of])]
        entries = valid_entries(matrix, [names[i] for i in rows_of],
                                [(dtypes[i], tuple(shapes[i]), BOX) for i in rows_of], checksums,
                                [*itertools.accumulate((counts[i] for i in rows_of), initial=0)], 1, dims, files,
                                file_sizes, block_bytes, make)
        if len(entries) != len(rows_of):
            return None
        out.update(entries)
    return {fqn: out[fqn] for fqn in names}  # (in the table's order)


def _matrix(rows_of: list[int], shapes: tuple, dims: int, file: np.ndarray, offset: np.ndarray, counts: list[int],
            item: np.ndarray) -> np.ndarray | None:
    """The rows ``rows_of`` (tensors of ``dims`` dimensions) as plain_entries lays out an entry
    of one piece: file, offset, nbytes, start, size, checksum count, shape, item size. None where
    a shape is negative, past 64 bits, or too large for a tensor (``shape_problem``)."""
    k = len(rows_of)
    try:
        shape = np.array([shapes[i] for i in rows_of], np.int64).reshape(k, dims)
    except OverflowError:
        return None
    isz = item[rows_of]
    if dims and (shape < 0).any():
        return None
    # a product that may pass 2**62 is checked exactly, as the general reader checks it
    strides = np.maximum(shape[:, 1:], 1).prod(axis=1, dtype=np.float64)
    total = shape.prod(axis=1, dtype=np.float64) * isz
    doubtful = np.flatnonzero((strides >= _SAFE_PRODUCT) | (total >= _SAFE_PRODUCT)).tolist()
    if any(shape_problem(shapes[rows_of[i]], int(isz[i])) for i in doubtful):
        return None
    return np.column_stack([file[rows_of], offset[rows_of], shape.prod(axis=1) * isz, np.zeros((k, dims), np.int64),
                            shape, np.array([counts[i] for i in rows_of], np.int64), shape, isz])


def _row_entry(name, shape, file, offset, sums) -> dict:
    """The JSON entry a row stands for, as far as the row allows: its byte count is computed only
    from a shape and dtype the general reader accepts (it refuses the others before it looks)."""
    dtype = NAME_TO_DTYPE.get(name) if type(name) is str else None
    plain = (type(shape) is list and all(type(s) is int and 0 <= s <= INT64_MAX for s in shape)
             and dtype is not None and not shape_problem(shape, dtype.itemsize))
    return {"dtype": name, "shape": shape, "layout": BOX, "file": [file], "offset": [offset],
            "nbytes": [math.prod(shape) * dtype.itemsize if plain else 0],
            "start": [[0] * len(shape) if plain else []], "size": [shape], "checksum": [sums]}
