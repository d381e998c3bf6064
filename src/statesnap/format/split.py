"""The split manifest (format version 2): a small index plus sections a rank reads only in part.

A version 1 manifest is one document that every loading rank parses whole: at 16,384 ranks that
is ~40 MB per rank for the few hundred pieces it needs. Version 2 keeps in ``manifest.json`` only
what every rank needs (header, file table, objects, one row per tensor) and moves the pieces into
*section* files, binary, each written by the rank that planned its tensors (plan/owners.py):

* per tensor a *head*: the largest extent of its pieces along the key dimension and, per
  *chunk* of at most ``CHUNK_PIECES`` pieces (pieces sorted by their start), the chunk's byte
  length, the key of its first piece, its piece count and checksum count;
* the chunks, right after their head: the piece columns of docs/format.md section 3.

A piece's *key* is its start along dimension 0 (a flat piece: its flat start; a 0-d piece: 0),
so a reader wanting rows ``[a, b)`` reads only the chunks whose keys can reach them, keys in
``(a - max_extent, b)``. Heads and chunks are *blobs*: a zlib stream of little-endian 64-bit
integers, then 8 bytes, the xxh3-64 of that stream (little-endian), so each is checked on its
own when read. docs/format.md section 11 specifies it.
"""
from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import xxhash

from ..errors import CorruptCheckpointError, ManifestError
from .boxes import region, tiling_problem
from .columns import (INFLATE_RATIO, INT64_MAX, InflationBudget, inflated, integer, parse_json, shape_problem,
                      shape_text)
from .dtypes import dtype_name, tensor_dtype

CHUNK_PIECES = 32
SECTION_PREFIX = "manifest-"
_TRAILER = 8
BOX = "box"
# fetch(section file name, offset, nbytes) -> those bytes of the section file
Fetch = Callable[[str, int, int], bytes]


def section_name(token: str, rank: int) -> str:
    return f"{SECTION_PREFIX}{token}-r{rank:05d}.sec"


def _blob(values: np.ndarray) -> bytes:
    stream = zlib.compress(np.ascontiguousarray(values).astype("<u8", copy=False).tobytes(), 6)
    return stream + xxhash.xxh3_64_intdigest(stream).to_bytes(8, "little")


def _unblob(raw: bytes, count: int, where: str) -> np.ndarray:
    """The ``count`` 64-bit values of a blob, its checksum checked, inflated no further than that."""
    if len(raw) < _TRAILER:
        raise CorruptCheckpointError(f"{where} is cut short")
    stream, recorded = memoryview(raw)[:-_TRAILER], int.from_bytes(raw[-_TRAILER:], "little")
    if xxhash.xxh3_64_intdigest(stream) != recorded:
        raise CorruptCheckpointError(f"{where} fails its checksum: the manifest section is damaged")
    expected = 8 * count
    if expected > INFLATE_RATIO * max(len(raw), 64):
        raise ManifestError(f"{where} claims {count} values, more than its {len(raw)} bytes may inflate to")
    try:
        data = inflated(stream, expected + 1, "the values it claims")
        if len(data) != expected:
            raise ValueError(f"{len(data)} bytes where {expected} belong")
    except (zlib.error, ValueError) as exc:
        raise ManifestError(f"{where} is malformed ({exc})") from None
    return np.frombuffer(data, "<u8")


def piece_keys(start: np.ndarray) -> np.ndarray:
    return start[:, 0] if start.shape[1] else np.zeros(len(start), np.int64)


@dataclass
class TensorRow:
    """A tensor's row in the index: what it is and where its head lies."""

    dtype: torch.dtype
    shape: tuple
    layout: str
    section: int  # index into the index's section table
    offset: int
    nbytes: int
    chunks: int


def encode_section(entries: dict, section: int = 0) -> tuple[bytes, dict[str, TensorRow]]:
    """Section bytes for ``entries`` (fqn -> TensorEntry) and their index rows."""
    parts, rows, at = [], {}, 0
    for fqn, entry in entries.items():
        dims = entry.start.shape[1]
        order = np.lexsort(entry.start.T[::-1]) if dims and len(entry.start) else np.arange(entry.num_pieces)
        counts = np.diff(entry.checksum_bounds)
        chunks, meta = [], []
        for lo in range(0, max(entry.num_pieces, 1), CHUNK_PIECES):
            sel = order[lo:lo + CHUNK_PIECES]
            sums = np.concatenate([entry.checksum[entry.checksum_bounds[i]:entry.checksum_bounds[i + 1]]
                                   for i in sel]) if len(sel) else np.zeros(0, np.uint64)
            ints = np.concatenate([entry.file[sel], entry.offset[sel], entry.nbytes[sel], entry.start[sel].reshape(-1),
                                   entry.size[sel].reshape(-1), counts[sel]]).astype(np.int64)
            blob = _blob(np.concatenate([ints.view(np.uint64), sums.astype(np.uint64)]))
            chunks.append(blob)
            meta += [len(blob), int(piece_keys(entry.start[sel[:1]])[0]) if len(sel) else 0, len(sel), len(sums)]
        extent = int(entry.size[:, 0].max()) if dims and entry.num_pieces else 0
        head = _blob(np.asarray([extent, *meta], np.int64).view(np.uint64))
        rows[fqn] = TensorRow(entry.dtype, tuple(entry.shape), entry.layout, section, at, len(head),
                              len(chunks))
        parts += [head, *chunks]
        at += len(head) + sum(map(len, chunks))
    return b"".join(parts), rows


class SectionReader:
    """Reads one tensor's pieces from its section: all of them, or the chunks a region needs."""

    def __init__(self, fetch: Fetch, sections: Sequence[str], world_size: int, where: str):
        self.fetch, self.sections, self.world_size, self.where = fetch, sections, world_size, where
        self.bytes_read = 0

    def _read(self, row: TensorRow, offset: int, nbytes: int) -> bytes:
        raw = self.fetch(self.sections[row.section], offset, nbytes)
        if len(raw) != nbytes:
            raise CorruptCheckpointError(f"{self.where}: section {self.sections[row.section]} is cut short")
        self.bytes_read += nbytes
        return raw

    def head(self, fqn: str, row: TensorRow) -> tuple[int, np.ndarray]:
        """(largest key extent, per chunk [nbytes, first key, pieces, checksums])."""
        where = f"{self.where}: section {self.sections[row.section]}: head of tensor {fqn!r}"
        values = _unblob(self._read(row, row.offset, row.nbytes), 1 + 4 * row.chunks, where).view(np.int64)
        chunks = values[1:].reshape(row.chunks, 4)
        if (chunks < 0).any() or values[0] < 0 or int(chunks[:, 2].sum()) > self.world_size:
            raise ManifestError(f"{where} is malformed (negative values or more pieces than ranks)")
        return int(values[0]), chunks

    def columns(self, fqn: str, row: TensorRow, lo_key: int | None = None, hi_key: int | None = None) -> dict:
        """The piece columns (file, offset, nbytes, start, size, checksum, checksum_bounds) of the
        chunks whose keys may reach ``[lo_key, hi_key)`` (None: all chunks)."""
        extent, chunks = self.head(fqn, row)
        dims = len(row.shape) if row.layout == BOX else 1
        firsts = chunks[:, 1]
        lasts = np.append(firsts[1:], np.iinfo(np.int64).max)  # a chunk's keys end at the next one's first
        wanted = np.ones(len(chunks), bool) if lo_key is None else (firsts < hi_key) & (lasts > lo_key - extent)
        starts = row.offset + row.nbytes + np.concatenate([[0], np.cumsum(chunks[:, 0])])
        parts = []
        for c in np.flatnonzero(wanted).tolist():
            n, sums = int(chunks[c, 2]), int(chunks[c, 3])
            where = f"{self.where}: section {self.sections[row.section]}: chunk {c} of tensor {fqn!r}"
            values = _unblob(self._read(row, int(starts[c]), int(chunks[c, 0])), n * (4 + 2 * dims) + sums, where)
            ints = values[:n * (4 + 2 * dims)].view(np.int64)
            file, offset, nbytes = ints[:n], ints[n:2 * n], ints[2 * n:3 * n]
            start = ints[3 * n:(3 + dims) * n].reshape(n, dims)
            size = ints[(3 + dims) * n:(3 + 2 * dims) * n].reshape(n, dims)
            counts = ints[(3 + 2 * dims) * n:]
            keys = piece_keys(start)
            beyond = bool(dims) and bool((size[:, 0] > extent).any())  # would hide from a key search
            if n and (int(counts.sum()) != sums or keys[0] != firsts[c] or (np.diff(keys) < 0).any()
                      or keys[-1] > lasts[c] or beyond):
                raise ManifestError(f"{where} is malformed (its pieces do not match its head)")
            parts.append((file, offset, nbytes, start, size, values[n * (4 + 2 * dims):], counts))
        if not parts:
            empty = np.zeros(0, np.int64)
            return dict(file=empty, offset=empty, nbytes=empty, start=np.zeros((0, dims), np.int64),
                        size=np.zeros((0, dims), np.int64), checksum=np.zeros(0, np.uint64),
                        checksum_bounds=np.zeros(1, np.int64))
        file, offset, nbytes, start, size, sums, counts = (np.concatenate(c) for c in zip(*parts))
        return dict(file=file, offset=offset, nbytes=nbytes, start=start, size=size, checksum=sums,
                    checksum_bounds=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))


def region_problem(start: np.ndarray, size: np.ndarray, t0: Sequence[int], ts: Sequence[int], fqn: str) -> str | None:
    """Whether the pieces read for a target box hold each of its elements exactly once: a reader
    of part of a tensor cannot check the whole tensor's tiling, so it checks its own region."""
    lo = np.maximum(start, np.asarray(t0, np.int64))
    hi = np.minimum(start + size, np.asarray(t0, np.int64) + np.asarray(ts, np.int64))
    hit = (hi > lo).all(axis=1)
    problem = tiling_problem(tuple(ts), (lo - np.asarray(t0, np.int64))[hit], (hi - lo)[hit],
                             lambda i: f"piece {region(lo[hit][i], hi[hit][i])}")
    return None if problem is None else f"tensor {fqn!r}: its pieces must cover the region read exactly once, but {problem}"


def pack_json(value) -> dict:
    """A JSON value stored zlib-compressed: the index's long lists (file names, tensor rows)
    shrink several times, which every loading rank reads."""
    return {"zjson": base64.b64encode(zlib.compress(json.dumps(value, separators=(",", ":")).encode(), 6)).decode()}


def unpack_json(value, budget: InflationBudget, where: str):
    """A plain JSON value, or a ``pack_json`` one, inflated no further than ``budget`` allows."""
    if not (isinstance(value, dict) and set(value) == {"zjson"}):
        return value
    try:
        data = inflated(base64.b64decode(value["zjson"], validate=True), budget.left + 1, "the manifest's budget")
        budget.take(len(data), where)
        return parse_json(data)
    except (ValueError, zlib.error, TypeError, RecursionError) as exc:  # (recursion: absurd nesting)
        raise ValueError(f"malformed packed value ({exc})") from None


def parse_rows(value, sections: Sequence[int], world_size: int, where: str) -> dict[str, TensorRow]:
    """The index's tensor rows, each checked: a known dtype and layout, integers where integers
    belong, its head inside its section. Every loading rank parses all of them, so the checks
    are inline rather than a call per number. ``where``: the index, for the error of an unknown dtype."""
    rows, dtypes = {}, {}
    for row in value:
        if not isinstance(row, list) or len(row) != 8 or not isinstance(row[0], str):
            raise ValueError("a tensor row is [name, dtype, shape, layout, section, offset, nbytes, chunks]")
        fqn, dtype, shape, layout, section, offset, nbytes, chunks = row
        if layout not in (BOX, "flat") or not isinstance(shape, list) or fqn in rows:
            raise ValueError(f"tensor {fqn!r}: unknown layout, malformed shape or named twice")
        numbers = (*shape, section, offset, nbytes, chunks)
        if not all(type(n) is int and 0 <= n <= INT64_MAX for n in numbers):  # not bool, not float
            raise ValueError(f"tensor {fqn!r}: its row holds what is not an integer in 0..2**63 - 1")
        if section >= len(sections) or nbytes > sections[section] - offset or chunks > world_size:
            raise ValueError(f"tensor {fqn!r}: its head lies outside its section or has too many chunks")
        if dtype not in dtypes:
            dtypes[dtype] = tensor_dtype(dtype, f"{where}: tensor {fqn!r}")
        problem = shape_problem(shape, dtypes[dtype].itemsize)
        if problem:
            raise ValueError(f"tensor {fqn!r}: {shape_text(shape)} {problem}")
        rows[fqn] = TensorRow(dtypes[dtype], tuple(shape), layout, section, offset, nbytes, chunks)
    return rows


def row_json(fqn: str, row: TensorRow) -> list:
    return [fqn, dtype_name(row.dtype), list(row.shape), row.layout, row.section, row.offset, row.nbytes, row.chunks]


def pack_files(files: Sequence[str], sections: int) -> dict | list:
    """The file table of an index, compact when every name follows statesnap's own patterns with
    one token (a save's): ``{"token", "data", "sections"}``, the writing ranks of the data files
    and of the section files as ``[first, last]`` runs. At 16,384 ranks the names would otherwise
    be a third of the index, which every loading rank reads. Other names: a packed list."""
    data, tail = files[:len(files) - sections], files[len(files) - sections:]
    token = files[0][5:17] if files and files[0].startswith("data-") else ""
    if all(name == f"data-{token}-r{rank:05d}.bin" for name, rank in zip(data, _ranks_of(data))) and \
            all(name == f"{SECTION_PREFIX}{token}-r{rank:05d}.sec" for name, rank in zip(tail, _ranks_of(tail))):
        return {"token": token, "data": _runs(_ranks_of(data)), "sections": _runs(_ranks_of(tail))}
    return pack_json(list(files))


def unpack_files(value, count: int, budget: InflationBudget, where: str) -> list[str]:
    """The names of a file table of ``count`` files (the length of ``file_sizes``, whose own
    bytes bound it) from a list, a packed list or ``pack_files``' compact form."""
    if not (isinstance(value, dict) and set(value) == {"token", "data", "sections"}):
        return unpack_json(value, budget, where)
    token = value["token"]
    if not (isinstance(token, str) and len(token) == 12):
        raise ValueError("the token of a compact file table has 12 characters")
    names = []
    for pattern, runs in ((f"data-{token}-r{{:05d}}.bin", value["data"]), (f"{SECTION_PREFIX}{token}-r{{:05d}}.sec",
                                                                        value["sections"])):
        for first, last in (map(integer, run) for run in unpack_json(runs, budget, where)):
            if last < first or last - first >= count - len(names):
                raise ValueError("a compact file table names more files than it has sizes")
            names += [pattern.format(rank) for rank in range(first, last + 1)]
    return names


def _ranks_of(names: Sequence[str]) -> list[int]:
    return [int(name.rsplit("-r", 1)[1].split(".")[0]) if "-r" in name else -1 for name in names]


def _runs(ranks: list[int]) -> dict:
    runs = []
    for rank in ranks:
        if runs and runs[-1][1] == rank - 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return pack_json(runs)
