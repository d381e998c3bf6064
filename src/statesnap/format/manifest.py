"""The manifest: a versioned JSON document that describes a checkpoint completely.

Pieces are stored column-wise per tensor (arrays of files, offsets, lengths, boxes) so that a
checkpoint of millions of pieces stays small and loads into numpy in one pass; see docs/format.md.
Parsing validates everything a later stage would trust: dtypes, file names (no path may leave the
checkpoint directory), indices, byte ranges and boxes. A manifest that passes cannot make a
reader write outside a target tensor or read outside a file.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import ManifestError
from .checksum import DEFAULT_BLOCK_BYTES
from .columns import PACK_MIN_PIECES, integer, pack, unpack
from .dtypes import dtype_from_name, dtype_name, itemsize

FORMAT_NAME = "statesnap"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
_SAFE_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")
BOX, FLAT = "box", "flat"


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
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

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
        out.update(file=pack(self.file, delta=True), offset=pack(self.offset, delta=True),
                   nbytes=pack(self.nbytes), start=pack(self.start), size=pack(self.size),
                   checksum=pack(self.checksum, "u8", compress=False))
        if (counts != 1).any():
            out["checksum_blocks"] = pack(counts)
        return out

    @classmethod
    def from_json(cls, fqn: str, data: dict, files: list[str], file_sizes: list[int],
                  block_bytes: int) -> "TensorEntry":
        try:
            dtype = dtype_from_name(data["dtype"], fqn)
            shape = tuple(integer(s) for s in data["shape"])
            layout = data["layout"]
            if layout not in (BOX, FLAT):
                raise ManifestError(f"tensor {fqn!r}: unknown layout {layout!r}")
            file = data["file"]
            n = len(file) if isinstance(file, list) else integer(file["shape"][0])
            dims = len(shape) if layout == BOX else 1
            where = f"tensor {fqn!r}"
            checksum, bounds = _checksum_columns(data, n, where)
            entry = cls(
                dtype=dtype, shape=shape, layout=layout,
                file=unpack(file, "i8", (n,), where), offset=unpack(data["offset"], "i8", (n,), where),
                nbytes=unpack(data["nbytes"], "i8", (n,), where),
                start=unpack(data["start"], "i8", (n, dims), where), size=unpack(data["size"], "i8", (n, dims), where),
                checksum=checksum, checksum_bounds=bounds,
            )
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ManifestError(f"tensor {fqn!r}: malformed manifest entry ({exc})") from None
        entry._validate(fqn, files, file_sizes, block_bytes)
        return entry

    def _validate(self, fqn: str, files: list[str], file_sizes: list[int], block_bytes: int) -> None:
        def bad(msg):
            raise ManifestError(f"tensor {fqn!r}: {msg}")

        if any(s < 0 for s in self.shape):
            bad(f"negative shape {self.shape}")
        if len(self.checksum_bounds) != self.num_pieces + 1 or self.checksum_bounds[-1] != len(self.checksum):
            bad("checksum column does not match pieces")
        if self.num_pieces == 0:
            return
        if self.file.min() < 0 or self.file.max() >= len(files):
            bad("piece refers to a file index outside the file table")
        if (self.start < 0).any() or (self.size < 0).any() or (self.offset < 0).any():
            bad("negative offset or extent")
        limit = np.asarray(self.shape if self.layout == BOX else [self.numel], dtype=np.int64)
        if (self.start + self.size > limit).any():
            bad(f"a piece lies outside the global shape {list(self.shape)}")
        elems = self.size.prod(axis=1) if self.size.shape[1] else np.ones(self.num_pieces, np.int64)
        if (elems * itemsize(self.dtype) != self.nbytes).any():
            bad("piece byte length does not match its extent and dtype")
        ends = self.offset + self.nbytes
        sizes = np.asarray(file_sizes, dtype=np.int64)[self.file]
        if (ends > sizes).any():
            i = int(np.argmax(ends > sizes))
            bad(f"piece {i} ends at byte {int(ends[i])} beyond the recorded size of {files[self.file[i]]}")
        expected = np.maximum(1, -(-self.nbytes // block_bytes))
        wrong = np.nonzero(np.diff(self.checksum_bounds) != expected)[0]
        if len(wrong):
            bad(f"piece {int(wrong[0])} has the wrong number of checksums: one per {block_bytes}-byte block expected")


def _checksum_columns(data: dict, n: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(flat checksums, per-piece bounds) from the plain or packed ``checksum`` column."""
    column = data["checksum"]
    if isinstance(column, list):
        if len(column) != n:
            raise ManifestError(f"{where}: checksum list length does not match pieces")
        per_piece = [c if isinstance(c, list) else [c] for c in column]
        try:
            return TensorEntry.pack_checksums([[integer(x) for x in c] for c in per_piece])
        except (TypeError, ValueError, OverflowError) as exc:
            raise ManifestError(f"{where}: malformed checksum ({exc})") from None
    counts = (unpack(data["checksum_blocks"], "i8", (n,), where) if "checksum_blocks" in data
              else np.ones(n, np.int64))
    if (counts < 1).any():
        raise ManifestError(f"{where}: malformed checksum block counts")
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return unpack(column, "u8", (int(bounds[-1]),), where), bounds


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
    def from_json(cls, fqn: str, data: Any, files: list[str], file_sizes: list[int]) -> "ObjectEntry":
        if not isinstance(data, dict) or len(data) != 1:
            raise ManifestError(f"object {fqn!r}: malformed entry")
        (kind, value), = data.items()
        if kind == "json":
            return cls("json", value)
        if kind == "pickle":
            try:
                file, offset, nbytes, checksum = (integer(v) for v in value)
            except (TypeError, ValueError):
                raise ManifestError(f"object {fqn!r}: malformed pickle reference") from None
            if not 0 <= file < len(files) or offset < 0 or nbytes < 0 or offset + nbytes > file_sizes[file]:
                raise ManifestError(f"object {fqn!r}: pickle reference outside its data file")
            return cls("pickle", [file, offset, nbytes, checksum])
        if kind == "per_rank" and isinstance(value, list):
            return cls("per_rank", per_rank=[cls.from_json(fqn, v, files, file_sizes) for v in value])
        raise ManifestError(f"object {fqn!r}: unknown kind {kind!r}")


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
        doc = {
            "format": FORMAT_NAME, "version": self.version, "world_size": self.world_size,
            "block_bytes": self.block_bytes, "created_unix": time.time(),
            "torch_version": torch.__version__, "meta": self.meta,
            "files": self.files, "file_sizes": self.file_sizes,
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            "objects": {k: v.to_json() for k, v in self.objects.items()},
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, where: str = "manifest") -> "Manifest":
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
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
        try:
            files = doc["files"]
            if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
                raise TypeError("'files' must be a list of names")
            file_sizes = [integer(s) for s in doc["file_sizes"]]
            block_bytes, world_size = integer(doc["block_bytes"]), integer(doc["world_size"])
            tensors_doc, objects_doc = doc["tensors"], doc["objects"]
            if not isinstance(tensors_doc, dict) or not isinstance(objects_doc, dict):
                raise TypeError("'tensors' and 'objects' must be JSON objects")
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where} is missing or has malformed field {exc}") from None
        for name in files:
            if not _SAFE_FILE.fullmatch(name) or name in (".", ".."):
                raise ManifestError(f"{where} names data file {name!r}, which is not a plain file name "
                                    "inside the checkpoint directory; refusing to read it")
        if len(file_sizes) != len(files) or block_bytes <= 0 or world_size < 1:
            raise ManifestError(f"{where} has an inconsistent file table")
        both = sorted(set(tensors_doc) & set(objects_doc))
        if both:
            raise ManifestError(f"{where} names {both[0]!r} both as a tensor and as an object")
        tensors = {k: TensorEntry.from_json(k, v, files, file_sizes, block_bytes) for k, v in tensors_doc.items()}
        objects = {k: ObjectEntry.from_json(k, v, files, file_sizes) for k, v in objects_doc.items()}
        for fqn, entry in objects.items():
            if entry.kind == "per_rank" and len(entry.per_rank) != world_size:
                raise ManifestError(f"{where}: object {fqn!r} has {len(entry.per_rank)} per-rank values "
                                    f"for a world of {world_size}")
        return cls(files=files, file_sizes=file_sizes, tensors=tensors, objects=objects,
                   world_size=world_size, block_bytes=block_bytes, meta=dict(doc.get("meta") or {}),
                   version=version)
