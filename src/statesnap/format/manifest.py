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
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import xxhash

from ..errors import CorruptCheckpointError, ManifestError
from .checksum import DEFAULT_BLOCK_BYTES
from .boxes import first_outside, region, tiling_problem
from .columns import (INT64_MAX, PACK_MIN_PIECES, PACK_ZLIB_MAX_DIMS, UINT64_MAX, InflationBudget, integer,
                      pack, unpack)
from .dtypes import dtype_from_name, dtype_name

FORMAT_NAME = "statesnap"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
_SAFE_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")
BOX, FLAT = "box", "flat"
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

    @staticmethod
    def pack_checksums(per_piece: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
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

    def to_json(self) -> dict:
        out = {"dtype": dtype_name(self.dtype), "shape": list(self.shape), "layout": self.layout}
        counts = np.diff(self.checksum_bounds)
        if self.num_pieces < PACK_MIN_PIECES:
            out.update(file=self.file.tolist(), offset=self.offset.tolist(), nbytes=self.nbytes.tolist(),
                       start=self.start.tolist(), size=self.size.tolist(),
                       checksum=[self.piece_checksums(i) if counts[i] != 1 else int(self.checksum[self.checksum_bounds[i]])
                                 for i in range(self.num_pieces)])
            return out
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
    def from_json(cls, fqn: str, data: dict, files: list[str], file_sizes: list[int] | np.ndarray,
                  block_bytes: int, where: str = "manifest", world_size: int | None = None,
                  budget: InflationBudget | None = None) -> "TensorEntry":
        """The entry of tensor ``fqn``, validated. ``world_size``: the most pieces it may have
        (each rank writes at most one piece of a tensor); ``budget``: what its packed columns may
        inflate to, shared with the other tensors of the manifest."""
        where = f"{where}: tensor {fqn!r}"
        if not isinstance(data, dict):
            raise ManifestError(f"{where} is malformed (not a JSON object)")
        try:
            dtype = dtype_from_name(data.get("dtype"))
        except ManifestError as exc:
            raise ManifestError(f"{where}: {exc}") from None
        shape = _field(data, "shape", where, lambda v: tuple(integer(s) for s in v))
        if math.prod(shape) * dtype.itemsize > INT64_MAX:
            raise ManifestError(f"{where} has malformed field 'shape' ({list(shape)} holds more than 2**63 - 1 bytes)")
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

    def _validate(self, where: str, files: list[str], file_sizes: list[int] | np.ndarray, block_bytes: int) -> None:
        """Rules 5 and 6 of docs/format.md §8, in an order where each check may rely on the ones
        before it (all values non-negative and inside the shape before any sum or product)."""
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


@dataclass
class Manifest:
    files: list[str]
    file_sizes: list[int]
    tensors: dict[str, TensorEntry]
    objects: dict[str, ObjectEntry]
    world_size: int = 1
    block_bytes: int = DEFAULT_BLOCK_BYTES
    meta: dict = field(default_factory=dict)
    version: int = FORMAT_VERSION

    def keys(self) -> list[str]:
        return sorted([*self.tensors, *self.objects])

    @property
    def total_bytes(self) -> int:
        return sum(self.file_sizes)

    def to_bytes(self) -> bytes:
        """The manifest's JSON, compact, ending in its checksum of itself (``SELF_CHECKSUM``)."""
        doc = {
            "format": FORMAT_NAME, "version": self.version, "world_size": self.world_size,
            "block_bytes": self.block_bytes, "created_unix": time.time(),
            "torch_version": torch.__version__, "meta": self.meta,
            "files": self.files, "file_sizes": self.file_sizes,
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            "objects": {k: v.to_json() for k, v in self.objects.items()},
        }
        body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        return b"%s%s%d}" % (body[:-1], _SELF_TAIL, xxhash.xxh3_64_intdigest(body))

    @classmethod
    def from_bytes(cls, raw: bytes, where: str = "manifest") -> "Manifest":
        """Parse and validate (docs/format.md section 8). The manifest's checksum of itself is
        checked after the rules that guard against a hostile manifest, which could recompute it:
        a manifest that breaks one of those raises their ``ManifestError`` (saying when the
        checksum fails too), one that breaks none but fails its checksum a
        ``CorruptCheckpointError``."""
        if not isinstance(raw, bytes):  # the checksum is of bytes
            raw = raw.encode() if isinstance(raw, str) else bytes(raw)
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # recursion: absurd nesting
            raise ManifestError(f"{where} is not valid JSON ({exc}); the checkpoint is damaged or not "
                                "a statesnap checkpoint") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where} is not a statesnap manifest")
        version = doc.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ManifestError(f"{where} has an invalid format version {version!r}")
        if version > FORMAT_VERSION:
            raise ManifestError(f"{where} has format version {version}, newer than this statesnap "
                                f"reads ({FORMAT_VERSION}); upgrade statesnap to load it")
        damage = _self_check(raw, doc, where)
        try:
            manifest = cls._from_doc(doc, version, where, InflationBudget(len(raw)))
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
    def _from_doc(cls, doc: dict, version: int, where: str, budget: InflationBudget) -> "Manifest":
        files = _field(doc, "files", where, _names)
        file_sizes = _field(doc, "file_sizes", where, lambda v: [integer(n) for n in v])
        block_bytes = _field(doc, "block_bytes", where, lambda v: integer(v, low=1))
        world_size = _field(doc, "world_size", where, lambda v: integer(v, low=1))
        tensors_doc, objects_doc = (_field(doc, name, where, _json_object) for name in ("tensors", "objects"))
        meta = _field(doc, "meta", where, _json_object) if "meta" in doc else {}
        for name in files:
            if not _SAFE_FILE.fullmatch(name) or name in (".", ".."):
                raise ManifestError(f"{where} names data file {name!r}, which is not a plain file name "
                                    "inside the checkpoint directory; refusing to read it")
        if len(file_sizes) != len(files):
            raise ManifestError(f"{where} has an inconsistent file table ({len(files)} files, "
                                f"{len(file_sizes)} sizes)")
        both = sorted(set(tensors_doc) & set(objects_doc))
        if both:
            raise ManifestError(f"{where} names {both[0]!r} both as a tensor and as an object")
        sizes = np.asarray(file_sizes, dtype=np.int64)  # once, not per tensor
        tensors = {k: TensorEntry.from_json(k, v, files, sizes, block_bytes, where, world_size, budget)
                   for k, v in tensors_doc.items()}
        objects = {k: ObjectEntry.from_json(k, v, files, file_sizes, where) for k, v in objects_doc.items()}
        for fqn, entry in objects.items():
            if entry.kind == "per_rank" and len(entry.per_rank) != world_size:
                raise ManifestError(f"{where}: object {fqn!r} has {len(entry.per_rank)} per-rank values "
                                    f"for a world of {world_size}")
        return cls(files=files, file_sizes=file_sizes, tensors=tensors, objects=objects,
                   world_size=world_size, block_bytes=block_bytes, meta=dict(meta), version=version)


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
    return value


def _json_object(value: Any) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"a JSON object is expected, not {type(value).__name__}")
    return value
