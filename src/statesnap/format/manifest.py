"""The manifest: a versioned JSON document that describes a checkpoint completely.

Pieces are stored column-wise per tensor (arrays of files, offsets, lengths, boxes) so that a
checkpoint of millions of pieces stays small and loads into numpy in one pass; see docs/format.md.
Parsing validates everything a later stage would trust: dtypes, file names (no path may leave the
checkpoint directory), every integer's range (so nothing overflows numpy's 64 bits further on),
indices, byte ranges, boxes, and that each tensor's pieces hold every element exactly once
(format/boxes.py). A manifest that passes cannot make a reader write outside a target tensor,
leave part of it unwritten, or read outside a file; nor can a small one inflate into a huge one
(a tensor has at most ``world_size`` pieces, and all packed columns share one budget).

The manifest also checks itself: its last member, ``manifest_xxh3``, is the xxh3-64 of the rest
of its bytes, so damage or an edit that still parses (a plain value inline in ``objects``, which
no block checksum covers) is a ``CorruptCheckpointError``, not a silent load.
"""
from __future__ import annotations

import json
import math
import operator
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch
import xxhash

from ..collector import collector_paused
from ..errors import CorruptCheckpointError, ManifestError, NewerFormatError
from .checksum import DEFAULT_BLOCK_BYTES
from .boxes import few_boxes_tile, first_outside, region, tiling_problem
from .columns import (PACK_MIN_PIECES, PACK_ZLIB_MAX_DIMS, UINT64_MAX, InflationBudget, integer, pack,
                      parse_json, shape_problem, shape_text, unpack)
from .dtypes import dtype_name, tensor_dtype
from .plain_entries import BOX, FEW_PIECES, FLAT, EntryRows, read_plain_entries
from .table import COLUMNS as TABLE_COLUMNS, FLAT_PIECES_VERSION, PIECES, parse_table, read_table, tables_json
from .plaindata import MAX_NESTING, int_too_long
from .split import (Fetch, SectionReader, TensorRow, pack_files, pack_json, parse_rows, region_problem, row_json,
                    unpack_files, unpack_json)

FORMAT_NAME = "statesnap"
# The newest version this reads. A one-document manifest is written as version 1, or as version 3
# where it has tables (format/table.py), 4 where one of them is ``pieces``; a split one as version 2.
FORMAT_VERSION = FLAT_PIECES_VERSION
MANIFEST_NAME = "manifest.json"
_ROW_ARRAYS = frozenset(("file", "offset", "nbytes", "start", "size", "checksum", "checksum_bounds"))
_SAFE_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")
# The manifest's checksum of itself: its last member, written exactly as `,"manifest_xxh3":<int>}`
# at the end of the file, the xxh3-64 of the manifest's bytes without it (ending in `}`).
SELF_CHECKSUM = "manifest_xxh3"
_SELF_TAIL = f',"{SELF_CHECKSUM}":'.encode()


@dataclass
class TensorEntry:
    """One logical tensor: dtype, global shape, and its stored pieces as parallel arrays.

    ``start``/``size`` have one row per piece: a box (offset and extent per dimension) when
    ``layout == "box"``, or one column holding a range of the row-major flattened tensor when
    ``layout == "flat"`` (ZeRO-style shards).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: str
    file: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    start: np.ndarray
    size: np.ndarray
    # Block checksums of all pieces back to back; piece i owns checksum[bounds[i]:bounds[i + 1]].
    checksum: np.ndarray
    checksum_bounds: np.ndarray
    # An entry read in a group of its kind (format/plain_entries.py) is made holding only the
    # group's columns and its row in them (not fields: neither copied nor compared). Its arrays
    # above are made when first asked for (``__getattr__``); until then loads read the columns
    # in their place (``group``).
    rows = None
    row = 0

    @classmethod
    def in_rows(cls, rows: EntryRows, names: list[str], heads: list[tuple], valid: list[bool]) -> dict:
        """fqn -> entry of each valid row of ``rows``, whose ``(dtype, shape, layout)`` is in
        ``heads``. (Made without ``__init__``, which took twice as long for a thousand entries.)"""
        new, out = object.__new__, {}
        for row, (name, (dtype, shape, layout), ok) in enumerate(zip(names, heads, valid)):
            if ok:
                entry = new(cls)
                entry.__dict__ = {"dtype": dtype, "shape": shape, "layout": layout, "rows": rows, "row": row}
                out[name] = entry
        return out

    @property
    def group(self) -> EntryRows | None:
        """The columns of the entries read with this one (its values at ``row``), while it has
        none of its arrays of its own, made or set: then they hold its values."""
        state = self.__dict__
        rows = state.get("rows")
        return rows if rows is not None and _ROW_ARRAYS.isdisjoint(state) else None

    def __getattr__(self, name: str):
        # (called only for what the instance lacks: an entry in rows, whose arrays are not made yet)
        rows = self.__dict__.get("rows")
        if rows is None or name not in _ROW_ARRAYS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        for key, value in rows.arrays_of(self.row).items():
            self.__dict__.setdefault(key, value)  # (not over an array set before any was made)
        return self.__dict__[name]

    def __getstate__(self) -> dict:
        """A copy or a pickle of the entry holds its own arrays, not its group's columns."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @staticmethod
    def pack_checksums(per_piece: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        if len(per_piece) == 1:  # most entries, built at every commit: numpy's per-call cost is the time here
            return np.array(per_piece[0], np.uint64), np.array((0, len(per_piece[0])), np.int64)
        counts = np.fromiter((len(c) for c in per_piece), np.int64, len(per_piece))
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        flat = np.fromiter((x for c in per_piece for x in c), np.uint64, int(bounds[-1]))
        return flat, bounds

    def piece_checksums(self, i: int) -> list[int]:
        return self.checksum[self.checksum_bounds[i]:self.checksum_bounds[i + 1]].tolist()

    @property
    def num_pieces(self) -> int:
        return len(self.file)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # a Python int: exact for any shape

    @property
    def stored_bytes(self) -> int:
        return int(self.nbytes.sum())

    @property
    def whole_in_one_piece(self) -> bool:
        """Whether the tensor is stored whole in one box piece: what one process saves, so most
        tensors (written as a row of format/table.py's ``table``, and loaded without a plan).
        Not an entry of one piece that is a part: a split manifest's entry holds only the pieces
        a target reaches. (A box as large as the shape starts at 0: every entry's boxes lie inside
        its shape, as read or as saved.)"""
        group = self.group
        if group is not None:
            return group.whole[self.row]
        return self.layout == BOX and len(self.file) == 1 and self.size[0].tolist() == list(self.shape)

    def checksums_json(self) -> list:
        """Each piece's block checksums as a manifest writes them: an integer for a piece of one
        block, else a list."""
        bounds, sums = self.checksum_bounds.tolist(), self.checksum.tolist()
        return [sums[a] if b - a == 1 else sums[a:b] for a, b in zip(bounds, bounds[1:])]

    def to_json(self) -> dict:
        out = {"dtype": dtype_name(self.dtype), "shape": list(self.shape), "layout": self.layout}
        if self.num_pieces < PACK_MIN_PIECES:
            # plain lists, one call each: this runs for every entry at every commit, on a thread
            # that holds the GIL the training's thread needs
            out.update(file=self.file.tolist(), offset=self.offset.tolist(), nbytes=self.nbytes.tolist(),
                       start=self.start.tolist(), size=self.size.tolist(), checksum=self.checksums_json())
            return out
        counts = np.diff(self.checksum_bounds)
        # many-dimensional boxes stay uncompressed: the manifest keeps within the inflation budget
        # its reader allows (format/columns.py), whatever the layout
        boxes = self.start.shape[1] <= PACK_ZLIB_MAX_DIMS
        out.update(file=pack(self.file, delta=True), offset=pack(self.offset, delta=True),
                   nbytes=pack(self.nbytes), start=pack(self.start, compress=boxes),
                   size=pack(self.size, compress=boxes),
                   checksum=pack(self.checksum, "u8", compress=False))
        if (counts != 1).any():
            out["checksum_blocks"] = pack(counts)
        return out

    @classmethod
    def read_all(cls, docs: dict, files: list[str], file_sizes: np.ndarray, block_bytes: int,
                 where: str = "manifest", world_size: int | None = None,
                 budget: InflationBudget | None = None) -> dict[str, "TensorEntry"]:
        """The entries of ``docs`` (fqn -> JSON object), validated, in their order: the plain
        ones of a few pieces all together (format/plain_entries.py), the others one by one
        (:meth:`from_json`, which also names what is wrong with any entry)."""
        file_sizes = np.asarray(file_sizes, dtype=np.int64)
        plain = read_plain_entries(docs, files, file_sizes, block_bytes, world_size or FEW_PIECES, cls.in_rows)
        return {fqn: plain[fqn] if fqn in plain else
                cls.from_json(fqn, data, files, file_sizes, block_bytes, where, world_size, budget)
                for fqn, data in docs.items()}

    @classmethod
    def from_json(cls, fqn: str, data: dict, files: list[str], file_sizes: list[int] | np.ndarray,
                  block_bytes: int, where: str = "manifest", world_size: int | None = None,
                  budget: InflationBudget | None = None) -> "TensorEntry":
        """The entry of tensor ``fqn``, validated. ``world_size``: the most pieces it may have
        (each rank writes at most one piece of a tensor); ``budget``: what its packed columns may
        inflate to, shared with the other tensors of the manifest."""
        where = f"{where}: tensor {fqn!r}"
        if not isinstance(data, dict):
            raise ManifestError(f"{where} is malformed (not a JSON object)")
        dtype = tensor_dtype(data.get("dtype"), where)
        shape = _field(data, "shape", where, lambda v: tuple(integer(s) for s in v))
        problem = shape_problem(shape, dtype.itemsize)
        if problem:
            raise ManifestError(f"{where} has malformed field 'shape' ({shape_text(shape)} {problem})")
        layout = data.get("layout")
        if layout not in (BOX, FLAT):
            raise ManifestError(f"{where}: unknown layout {layout!r}")
        # the file column first: the piece count it declares is capped by the world size, and a
        # packed column's length is checked against its bytes and the manifest's inflation budget,
        # so a made-up piece count never sizes an allocation below
        n = _field(data, "file", where, lambda v: len(v) if isinstance(v, list) else integer(v["shape"][0]))
        if world_size is not None and n > world_size:
            raise ManifestError(f"{where} has {n} pieces, more than the {world_size} ranks that saved it "
                                "(a rank writes at most one piece of each tensor)")
        file = _field(data, "file", where, lambda v: unpack(v, "i8", (n,), f"{where}: column 'file'", budget))
        dims = len(shape) if layout == BOX else 1
        columns = {name: _field(data, name, where, lambda v, name=name: unpack(
            v, "i8", (n, dims) if name in ("start", "size") else (n,), f"{where}: column {name!r}", budget))
            for name in ("offset", "nbytes", "start", "size")}
        checksum, bounds = _field(data, "checksum", where,
                                  lambda v: _checksum_columns(v, data.get("checksum_blocks"), n, where, budget))
        entry = cls(dtype=dtype, shape=shape, layout=layout, file=file, checksum=checksum, checksum_bounds=bounds,
                    **columns)
        entry._validate(where, files, file_sizes, block_bytes)
        return entry

    def _plainly_valid(self, files: list[str], file_sizes: list[int] | np.ndarray, block_bytes: int) -> bool:
        """Whether an entry of up to ``FEW_PIECES`` pieces passes every rule of :meth:`_validate`,
        decided in plain Python, for entries checked one at a time (a split manifest's, read as a
        load needs them): the general checks cost 40 us per entry in numpy calls, these 6 us.
        (Entries of a one-document manifest are checked all together: format/plain_entries.py.)
        False sends the entry through the general checks (which then name what is wrong, or
        accept what this does not decide)."""
        bounds = self.checksum_bounds.tolist()
        if not 0 < len(self.file) <= FEW_PIECES or len(bounds) != len(self.file) + 1 or bounds[0] != 0:
            return False
        return _plain_rules(self.dtype, self.shape, self.layout, files, file_sizes, block_bytes, self.file.tolist(),
                            self.offset.tolist(), self.nbytes.tolist(), self.start.tolist(), self.size.tolist(),
                            [b - a for a, b in zip(bounds, bounds[1:])])

    def _validate(self, where: str, files: list[str], file_sizes: list[int] | np.ndarray, block_bytes: int,
                  tiling: bool = True) -> None:
        """Rules 5 and 6 of docs/format.md §8, in an order where each check may rely on the ones
        before it (all values non-negative and inside the shape before any sum or product).
        ``tiling=False``: the entry holds only some of the tensor's pieces (a split manifest read
        in part), so rule 6 is checked by the reader for the region it reads instead."""
        if tiling and self._plainly_valid(files, file_sizes, block_bytes):
            return

        def bad(msg):
            raise ManifestError(f"{where}: {msg}")

        if self.num_pieces and (self.file.min() < 0 or self.file.max() >= len(files)):
            bad("piece refers to a file index outside the file table")
        if (self.offset < 0).any() or (self.nbytes < 0).any():
            bad("negative offset or byte length")
        outside = first_outside(self.start, self.size, self.shape if self.layout == BOX else [self.numel])
        if outside >= 0:
            bad(f"piece {outside} lies outside the global shape {list(self.shape)}")
        elems = self.size.prod(axis=1)  # inside a shape of < 2**63 bytes: exact
        if (elems * self.dtype.itemsize != self.nbytes).any():
            bad("piece byte length does not match its extent and dtype")
        room = np.asarray(file_sizes, dtype=np.int64)[self.file] - self.offset  # no overflow: both >= 0
        beyond = np.flatnonzero(self.nbytes > room)
        if len(beyond):
            i = int(beyond[0])
            bad(f"piece {i} ends at byte {int(self.offset[i]) + int(self.nbytes[i])} beyond the recorded "
                f"size of {files[self.file[i]]}")
        expected = np.maximum(1, -(-self.nbytes // block_bytes))
        wrong = np.nonzero(np.diff(self.checksum_bounds) != expected)[0]
        if len(wrong):
            bad(f"piece {int(wrong[0])} has the wrong number of checksums: one per {block_bytes}-byte block expected")
        if not tiling:
            return
        problem = tiling_problem(self.shape if self.layout == BOX else (self.numel,), self.start, self.size,
                                 lambda i: f"piece {i} {region(self.start[i], self.start[i] + self.size[i])} "
                                           f"(in {files[self.file[i]]})")
        if problem:
            flat = " (flat ranges of the row-major tensor)" if self.layout == FLAT else ""
            bad(f"its pieces{flat} must cover it exactly once, but {problem}")


def _checksum_columns(column: Any, blocks: Any, n: int, where: str,
                      budget: InflationBudget | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(flat checksums, per-piece bounds) from the plain or packed ``checksum`` column and the
    optional ``checksum_blocks`` (blocks per piece, when not all 1)."""
    if isinstance(column, list):
        if len(column) != n:
            raise ValueError(f"{len(column)} entries for {n} pieces")
        return TensorEntry.pack_checksums([[integer(x, high=UINT64_MAX) for x in c] if isinstance(c, list)
                                           else [integer(c, high=UINT64_MAX)] for c in column])
    counts = (np.ones(n, np.int64) if blocks is None
              else unpack(blocks, "i8", (n,), f"{where}: column 'checksum_blocks'", budget))
    # a count above 2**62 is no real piece's, and refusing it keeps the running sum below from wrapping
    if n and ((counts < 1).any() or counts.sum(dtype=np.float64) > 2.0 ** 62):
        raise ValueError("'checksum_blocks' holds a count below 1 or beyond any real piece's")
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return unpack(column, "u8", (int(bounds[-1]),), f"{where}: column 'checksum'", budget), bounds


def _plain_rules(dtype: torch.dtype, shape: tuple, layout: str, files: list[str], file_sizes: list[int] | np.ndarray,
                 block_bytes: int, file: list[int], offset: list[int], nbytes: list[int], start: list[list[int]],
                 size: list[list[int]], checksums: list[int]) -> bool:
    """The rules of docs/format.md §8 on plain integers, for a few pieces: each lies inside the
    tensor and inside its file, holds exactly its extent's bytes and has one checksum per block
    (one for no bytes), and together they cover the tensor exactly once."""
    limit = list(shape) if layout == BOX else [math.prod(shape)]
    if min(file) < 0 or max(file) >= len(files) or min(offset) < 0:
        return False
    isz = dtype.itemsize
    for f, o, n, lo, extent, count in zip(file, offset, nbytes, start, size, checksums):
        if lo and (min(lo) < 0 or min(extent) < 0 or not all(map(operator.le, extent, map(operator.sub, limit, lo)))):
            return False
        if n != math.prod(extent) * isz or n > int(file_sizes[f]) - o or count != max(1, -(-n // block_bytes)):
            return False
    return few_boxes_tile(limit, start, size)


@dataclass
class ObjectEntry:
    """A non-tensor value: tagged JSON, a reference to pickled bytes, or one of those per rank."""

    kind: str  # "json" | "pickle" | "per_rank"
    value: Any = None  # json: encoded value; pickle: [file, offset, nbytes, checksum]
    per_rank: list["ObjectEntry"] = field(default_factory=list)

    def to_json(self) -> dict:
        if self.kind == "per_rank":
            return {"per_rank": [e.to_json() for e in self.per_rank]}
        return {self.kind: self.value}

    @classmethod
    def from_json(cls, fqn: str, data: Any, files: list[str], file_sizes: list[int], where: str = "manifest",
                  nested: bool = False) -> "ObjectEntry":
        where = f"{where}: object {fqn!r}"
        if not isinstance(data, dict) or len(data) != 1:
            raise ManifestError(f"{where}: malformed entry")
        (kind, value), = data.items()
        if kind == "json":
            return cls("json", value)
        if kind == "pickle":
            try:
                if not isinstance(value, list) or len(value) != 4:
                    raise ValueError("[file, offset, nbytes, checksum] expected")
                file, offset, nbytes = (integer(v) for v in value[:3])
                checksum = integer(value[3], high=UINT64_MAX)
            except ValueError as exc:
                raise ManifestError(f"{where}: malformed pickle reference ({exc})") from None
            if file >= len(files) or nbytes > file_sizes[file] - offset:
                raise ManifestError(f"{where}: pickle reference outside its data file")
            return cls("pickle", [file, offset, nbytes, checksum])
        if kind == "per_rank" and nested:
            raise ManifestError(f"{where}: a per-rank value is a json or pickle entry, not another per_rank")
        if kind == "per_rank" and isinstance(value, list):
            return cls("per_rank", per_rank=[cls.from_json(fqn, v, files, file_sizes, where, True) for v in value])
        raise ManifestError(f"{where}: unknown kind {kind!r}")


class SplitTensors(Mapping):
    """The tensors of a split manifest (version 2, format/split.py), read from their sections
    when asked for: one tensor whole (validated like a version 1 entry) or, through ``part``,
    only the chunks of its pieces that a region needs."""

    def __init__(self, rows: dict[str, TensorRow], reader: SectionReader | None, manifest: "Manifest"):
        self.rows, self.reader, self.manifest = rows, reader, manifest
        self._whole: dict[str, TensorEntry] = {}

    def __getitem__(self, fqn: str) -> TensorEntry:
        if fqn not in self._whole:
            self._whole[fqn] = self._entry(fqn, None, None)
        return self._whole[fqn]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, fqn) -> bool:
        return fqn in self.rows

    def part(self, fqn: str, start: tuple, size: tuple) -> TensorEntry:
        """The pieces of box tensor ``fqn`` that the region ``start``/``size`` may need (some
        more: whole chunks are read), checked to hold each of the region's elements exactly once."""
        if fqn in self._whole:
            return self._whole[fqn]
        entry = self._entry(fqn, start[0], start[0] + size[0])
        problem = region_problem(entry.start, entry.size, start, size, fqn)
        if problem:
            raise ManifestError(f"{self.reader.where}: {problem}")
        return entry

    def _entry(self, fqn: str, lo: int | None, hi: int | None) -> TensorEntry:
        if self.reader is None:
            raise ManifestError(f"{fqn}: a split manifest (version 2) was parsed without access to its "
                                "section files; read it with statesnap.engine.load.read_manifest")
        row, m = self.rows[fqn], self.manifest
        entry = TensorEntry(dtype=row.dtype, shape=row.shape, layout=row.layout, **self.reader.columns(fqn, row, lo, hi))
        entry._validate(f"{self.reader.where}: tensor {fqn!r}", m.files, np.asarray(m.file_sizes, np.int64),
                        m.block_bytes, tiling=lo is None)
        return entry


@dataclass
class Manifest:
    files: list[str]
    file_sizes: list[int]
    tensors: Mapping[str, TensorEntry]
    objects: dict[str, ObjectEntry]
    world_size: int = 1
    block_bytes: int = DEFAULT_BLOCK_BYTES
    meta: dict = field(default_factory=dict)
    version: int = 1
    # a split manifest (version 2): which files of ``files`` are its sections (format/split.py);
    # ``tensors`` is then a SplitTensors
    sections: list[int] = field(default_factory=list)

    def keys(self) -> list[str]:
        return sorted([*self.tensors, *self.objects])

    @property
    def total_bytes(self) -> int:
        """Bytes of the data files (a split manifest's sections are in the file table too)."""
        return sum(self.file_sizes) - sum(self.file_sizes[i] for i in self.sections)

    def header(self, fqn: str) -> TensorEntry | TensorRow | None:
        """What tensor ``fqn`` is (``dtype``, ``shape``, ``layout``) without reading its pieces."""
        if isinstance(self.tensors, SplitTensors):
            return self.tensors.rows.get(fqn)
        return self.tensors.get(fqn)

    def tensor_part(self, fqn: str, layout: str, start: tuple, size: tuple) -> TensorEntry:
        """An entry holding (at least) the pieces of ``fqn`` a target part needs: from a split
        manifest only the chunks a box target's rows reach, else the whole entry."""
        if isinstance(self.tensors, SplitTensors):
            row = self.tensors.rows[fqn]
            if layout == BOX and row.layout == BOX and row.shape:
                return self.tensors.part(fqn, tuple(start), tuple(size))
        return self.tensors[fqn]

    def _head(self, version: int) -> dict:
        return {"format": FORMAT_NAME, "version": version, "world_size": self.world_size,
                "block_bytes": self.block_bytes, "created_unix": time.time(),
                "torch_version": torch.__version__, "meta": self.meta}

    def to_bytes(self) -> bytes:
        """The manifest as one document, compact, ending in its checksum of itself: version 3
        where enough tensors are stored in one piece to make a table of them, 4 where enough are
        stored in a few (an older statesnap reads the first), else 1."""
        tables = tables_json(self.tensors)
        tabled = {name for table in tables.values() for name in table["name"]}
        version = FLAT_PIECES_VERSION if PIECES in tables else 3 if tables else 1
        doc = {
            **self._head(version), "files": self.files, "file_sizes": self.file_sizes,
            "tensors": {k: v.to_json() for k, v in self.tensors.items() if k not in tabled}, **tables,
            "objects": {k: v.to_json() for k, v in self.objects.items()},
        }
        return _with_self_checksum(doc)

    def index_bytes(self, rows: dict[str, TensorRow]) -> bytes:
        """The index of a split manifest (version 2): ``rows`` locate each tensor in ``sections``."""
        doc = {
            **self._head(2), "files": pack_files(self.files, len(self.sections)),
            "file_sizes": pack_json(self.file_sizes), "sections": len(self.sections),
            "tensors": pack_json([row_json(fqn, row) for fqn, row in rows.items()]),
            "objects": {k: v.to_json() for k, v in self.objects.items()},
        }
        return _with_self_checksum(doc)

    @classmethod
    def from_bytes(cls, raw: bytes, where: str = "manifest", fetch: Fetch | None = None) -> "Manifest":
        """Parse and validate (docs/format.md section 8). The manifest's checksum of itself is
        checked after the rules that guard against a hostile manifest, which could recompute it:
        a manifest that breaks one of those raises their ``ManifestError`` (saying when the
        checksum fails too), one that breaks none but fails its checksum a
        ``CorruptCheckpointError``. ``fetch(name, offset, nbytes)`` reads a split manifest's
        section files (version 2); without it only its index is usable."""
        with collector_paused():  # ../collector.py
            return cls._parse(raw, where, fetch)

    @classmethod
    def _parse(cls, raw: bytes, where: str, fetch: Fetch | None) -> "Manifest":
        if not isinstance(raw, bytes):  # the checksum is of bytes
            raw = raw.encode() if isinstance(raw, str) else bytes(raw)
        try:
            doc = parse_json(raw)
        except (ValueError, RecursionError) as exc:  # recursion: absurd nesting; ValueError: bad UTF-8 or
            # JSON (NaN, 1e999: columns.parse_json), or an integer literal longer than Python converts (4,300 digits)
            raise ManifestError(f"{where} is not valid JSON ({exc}); the checkpoint is damaged or not "
                                "a statesnap checkpoint") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where} is not a statesnap manifest")
        version = doc.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ManifestError(f"{where} has an invalid format version {version!r}")
        if version > FORMAT_VERSION:
            if _flipped_version(raw, doc, version, where):
                raise CorruptCheckpointError(
                    f"{where} fails its own checksum and records format version {version}, "
                    f"newer than this statesnap reads ({FORMAT_VERSION}); with the version it was written "
                    "with, it passes: one bit of it was flipped. Load another checkpoint")
            raise NewerFormatError(f"{where} has format version {version}, newer than this statesnap "
                                   f"reads ({FORMAT_VERSION}); upgrade statesnap to load it")
        damage = _self_check(raw, doc, where)
        try:
            manifest = cls._from_doc(doc, version, where, InflationBudget(len(raw)), fetch)
        except ManifestError as exc:
            if damage is None:
                raise
            raise ManifestError(f"{exc}; the manifest also fails its own checksum ({damage})") from None
        if damage is not None:
            raise CorruptCheckpointError(
                f"{where} fails its own checksum: {damage}. It was damaged or edited after it was written, "
                "so nothing in it can be trusted; restore the checkpoint from a copy or load another one")
        return manifest

    @classmethod
    def _from_doc(cls, doc: dict, version: int, where: str, budget: InflationBudget,
                  fetch: Fetch | None = None) -> "Manifest":
        def packed(convert):  # version 2 may store a long list zlib'd (format/split.py)
            return lambda v: convert(unpack_json(v, budget, where) if version == 2 else v)

        file_sizes = _field(doc, "file_sizes", where, packed(lambda v: [integer(n) for n in v]))
        files = _field(doc, "files", where, lambda v: _names(
            unpack_files(v, len(file_sizes), budget, where) if version == 2 else v))
        block_bytes = _field(doc, "block_bytes", where, lambda v: integer(v, low=1))
        world_size = _field(doc, "world_size", where, lambda v: integer(v, low=1))
        objects_doc = _field(doc, "objects", where, _json_object)
        meta = _field(doc, "meta", where, _json_object) if "meta" in doc else {}
        sections = []
        if len(file_sizes) != len(files):
            raise ManifestError(f"{where} has an inconsistent file table ({len(files)} files, "
                                f"{len(file_sizes)} sizes)")
        tables = {member: _field(doc, member, where, lambda v, member=member: parse_table(v, member, version))
                  for member in TABLE_COLUMNS if version >= 3 and member in doc}
        table = {name: member for member, rows in tables.items() for name in rows.names}
        if len(table) != sum(len(rows.names) for rows in tables.values()):
            twice = sorted(set(tables["table"].names) & set(tables["pieces"].names))[0]
            raise ManifestError(f"{where} has two entries of tensor {twice!r}: one in 'table', one in 'pieces'")
        if version == 2:
            count = _field(doc, "sections", where, lambda v: integer(v, high=len(files)))
            sections = list(range(len(files) - count, len(files)))  # the last files of the table
            tensors_doc = _field(doc, "tensors", where, packed(
                lambda v: parse_rows(v, [file_sizes[i] for i in sections], world_size, where)))
        else:
            tensors_doc = _field(doc, "tensors", where, _json_object)
        for name in files:
            if not _SAFE_FILE.fullmatch(name) or name in (".", ".."):
                raise ManifestError(f"{where} names data file {name!r}, which is not a plain file name "
                                    "inside the checkpoint directory; refusing to read it")
        both = sorted(set(tensors_doc) & set(objects_doc) | set(table) & set(objects_doc))
        if both:
            raise ManifestError(f"{where} names {both[0]!r} both as a tensor and as an object")
        twice = sorted(set(tensors_doc) & set(table))
        if twice:
            raise ManifestError(f"{where} has two entries of tensor {twice[0]!r}: one in 'tensors', one in "
                                f"'{table[twice[0]]}'")
        objects = {k: ObjectEntry.from_json(k, v, files, file_sizes, where) for k, v in objects_doc.items()}
        for fqn, entry in objects.items():
            if entry.kind == "per_rank" and len(entry.per_rank) != world_size:
                raise ManifestError(f"{where}: object {fqn!r} has {len(entry.per_rank)} per-rank values "
                                    f"for a world of {world_size}")
        manifest = cls(files=files, file_sizes=file_sizes, tensors={}, objects=objects, world_size=world_size,
                       block_bytes=block_bytes, meta=dict(meta), version=version, sections=sections)
        if version == 2:
            reader = None if fetch is None else SectionReader(fetch, [files[i] for i in sections], world_size, where)
            manifest.tensors = SplitTensors(tensors_doc, reader, manifest)
            return manifest
        manifest.tensors = TensorEntry.read_all(tensors_doc, files, file_sizes, block_bytes, where, world_size,
                                                budget)
        for rows in tables.values():
            manifest.tensors.update(read_table(
                rows, files, np.asarray(file_sizes, dtype=np.int64), block_bytes, world_size,
                TensorEntry.in_rows,
                lambda fqn, data: TensorEntry.from_json(fqn, data, files, file_sizes, block_bytes, where, world_size,
                                                        budget)))
        return manifest


def _with_self_checksum(doc: dict) -> bytes:
    """``doc`` as compact JSON ending in its checksum of itself (``SELF_CHECKSUM``)."""
    body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return b"%s%s%d}" % (body[:-1], _SELF_TAIL, xxhash.xxh3_64_intdigest(body))


def _flipped_version(raw: bytes, doc: dict, version: int, where: str) -> bool:
    """Whether a manifest recording a newer ``version`` passes its checksum with a version this
    statesnap writes in its place: one flipped bit turns 1 into 5, and such a manifest is
    damaged, not newer. (A newer format may checksum itself some other way: only a match
    counts as damage.)"""
    recorded = b'"version":%d' % version
    if SELF_CHECKSUM not in doc or raw.count(recorded) != 1:
        return False
    try:
        return any(_self_check(raw.replace(recorded, b'"version":%d' % ours), doc, where) is None
                   for ours in range(1, FORMAT_VERSION + 1))
    except ManifestError:  # a checksum field this version does not know how to read
        return False


def _self_check(raw: bytes, doc: dict, where: str) -> str | None:
    """What is wrong with the manifest's checksum of itself; None if it matches, or if the
    manifest has none (written before statesnap wrote one: docs/format.md section 9)."""
    if SELF_CHECKSUM not in doc:
        # a key one character away is this one damaged, not a manifest from before it existed
        near = [key for key in doc if len(key) == len(SELF_CHECKSUM)
                and sum(x != y for x, y in zip(key, SELF_CHECKSUM)) == 1]
        return f"it has no field {SELF_CHECKSUM!r} but a field {near[0]!r}, its name damaged" if near else None
    recorded = _field(doc, SELF_CHECKSUM, where, lambda v: integer(v, high=UINT64_MAX))
    tail = b"%s%d}" % (_SELF_TAIL, recorded)
    if not raw.endswith(tail):
        return (f"its field {SELF_CHECKSUM!r} is not where the writer puts it, the document's last "
                "member and the file's last bytes; the manifest was rewritten")
    hasher = xxhash.xxh3_64(memoryview(raw)[:len(raw) - len(tail)])
    hasher.update(b"}")
    actual = hasher.intdigest()
    if actual != recorded:
        return f"its bytes hash to {actual:#018x} but its field {SELF_CHECKSUM!r} records {recorded:#018x}"
    return None


def _field(doc: dict, name: str, where: str, convert: Callable[[Any], Any]) -> Any:
    """``doc[name]`` through ``convert``, or a ManifestError naming the field."""
    if name not in doc:
        raise ManifestError(f"{where} is malformed: field {name!r} is missing")
    try:
        return convert(doc[name])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ManifestError(f"{where} has malformed field {name!r} ({exc})") from None


def _names(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise TypeError("a list of file names is expected")
    if len(set(value)) != len(value):  # one file under two indices: its size recorded twice, maybe differently
        raise TypeError("a file is named twice")
    return value


def meta_problem(meta: Any) -> str | None:
    """Why ``meta`` (``ss.save(..., meta=...)``) cannot be stored as the manifest's ``meta``, or
    None. What JSON holds is taken as any JSON writer takes it (subclasses of dict, list, str,
    int and float, such as an OrderedDict or a numpy float; a tuple, which comes back a list).
    Refused up front: what would fail the commit once every byte is written, in json's words
    (NaN, bytes, a numpy int), and a key that is no string, which JSON turns into one, so that
    ``{1: a, "1": b}`` would write a key twice and no reader would take the manifest."""
    if not isinstance(meta, dict):
        return f"meta must be a dict, not {type(meta).__name__}"
    try:
        return _json_problem(meta, "meta")
    except RecursionError:
        return "meta is nested too deeply"


def _json_problem(value: Any, where: str, depth: int = 0) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        problem = int_too_long(value)
        return f"{where} is {problem}" if problem else None
    if value is None or isinstance(value, (bool, str)) or (isinstance(value, float) and math.isfinite(value)):
        return None
    if isinstance(value, (list, tuple, dict)) and depth >= MAX_NESTING:  # (as plain data: plaindata.py)
        return f"{where} nests lists and dicts more than {MAX_NESTING} levels deep"
    if isinstance(value, (list, tuple)):
        return next(filter(None, (_json_problem(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))), None)
    if isinstance(value, dict):
        for key, v in value.items():
            if not isinstance(key, str):
                made = (f'would make it "{json.dumps(key)}"' if isinstance(key, (int, float)) or key is None
                        else "takes none")
                return f"{where} has the key {key!r}, which is not a string (JSON {made})"
            problem = _json_problem(v, f"{where}[{key!r}]", depth + 1)
            if problem:
                return problem
        return None
    kind = type(value)
    what = "a non-finite float" if isinstance(value, float) else f"of type {kind.__module__}.{kind.__qualname__}"
    return f"{where} is {what}, which JSON does not hold"


def _json_object(value: Any) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"a JSON object is expected, not {type(value).__name__}")
    return value
