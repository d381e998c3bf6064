"""Column encodings of the manifest: plain JSON arrays, or packed binary for large tensors.

A tensor sharded over a thousand ranks has a thousand pieces; written as JSON numbers each piece
costs ~60 bytes and parsing a 70B-model manifest takes seconds. Columns of tensors with many pieces
are therefore packed: little-endian 64-bit integers, optionally delta-coded (offsets grow by
near-constant steps) and zlib-compressed, in base64. Checksums are random, so they are packed but
not compressed. Small tensors keep plain arrays, so ordinary manifests stay readable by eye.
"""
from __future__ import annotations

import base64
import zlib
from typing import Any

import numpy as np

from ..errors import ManifestError

PACK_MIN_PIECES = 64
_DTYPES = {"i8": "<i8", "u8": "<u8"}


def pack(values: np.ndarray, kind: str = "i8", *, delta: bool = False, compress: bool = True) -> dict:
    arr = np.ascontiguousarray(values, dtype=_DTYPES[kind])
    flat = arr.reshape(-1)
    if delta and len(flat):
        flat = np.diff(flat, prepend=flat.dtype.type(0))
    raw = flat.tobytes()
    out: dict[str, Any] = {"packed": kind, "shape": list(arr.shape)}
    if delta:
        out["delta"] = True
    if compress:
        raw = zlib.compress(raw, 6)
        out["zlib"] = True
    out["data"] = base64.b64encode(raw).decode("ascii")
    return out


def integer(value: Any) -> int:
    """A manifest integer: JSON numbers like 2.7 or true are malformed, not 2 or 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    return value


def unpack(column: Any, kind: str, shape: tuple, where: str) -> np.ndarray:
    """A column as a numpy array of ``shape`` (JSON list or packed form)."""
    np_dtype = np.uint64 if kind == "u8" else np.int64
    if isinstance(column, list):
        try:
            values = np.asarray(column)
            if values.size and values.dtype.kind not in "iu":  # no floats, booleans or strings
                raise ValueError(f"{values.dtype} values where integers belong")
            return values.astype(np_dtype).reshape(shape)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ManifestError(f"{where}: malformed column ({exc})") from None
    if not isinstance(column, dict) or column.get("packed") != kind:
        raise ManifestError(f"{where}: column must be a JSON array or a packed {kind} column")
    if list(column.get("shape", ())) != list(shape):
        raise ManifestError(f"{where}: packed column has shape {column.get('shape')}, expected {list(shape)}")
    try:
        raw = base64.b64decode(column["data"], validate=True)
        if column.get("zlib"):
            raw = zlib.decompress(raw)
        flat = np.frombuffer(raw, dtype=_DTYPES[kind])
        if column.get("delta"):
            flat = np.cumsum(flat, dtype=flat.dtype)
        return flat.astype(np_dtype, copy=False).reshape(shape)
    except (KeyError, ValueError, zlib.error, TypeError) as exc:
        raise ManifestError(f"{where}: malformed packed column ({exc})") from None
