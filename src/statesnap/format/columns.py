"""Column encodings of the manifest: plain JSON arrays, or packed binary for large tensors.

A tensor sharded over a thousand ranks has a thousand pieces; written as JSON numbers each piece
costs ~60 bytes and parsing a 70B-model manifest takes seconds. Columns of tensors with many pieces
are therefore packed: little-endian 64-bit integers, optionally delta-coded (offsets grow by
near-constant steps) and zlib-compressed, in base64. Checksums are random, so they are packed but
not compressed. Small tensors keep plain arrays, so ordinary manifests stay readable by eye.
"""
from __future__ import annotations

import base64
import math
import zlib
from typing import Any

import numpy as np

from ..errors import ManifestError

PACK_MIN_PIECES = 64
INT64_MAX, UINT64_MAX = (1 << 63) - 1, (1 << 64) - 1
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


def integer(value: Any, low: int = 0, high: int = INT64_MAX) -> int:
    """A manifest integer in ``[low, high]``: JSON numbers like 2.7 or true are malformed, not 2
    or 1, and a value past 64 bits is refused here instead of overflowing numpy further on."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    if not low <= value <= high:
        raise ValueError(f"{value} is outside {low}..{high}")
    return value


def unpack(column: Any, kind: str, shape: tuple, where: str) -> np.ndarray:
    """A column as a numpy array of ``shape`` (JSON list or packed form). Plain values are checked
    one by one (exact JSON integers in the kind's range); packed ones are 64-bit by construction."""
    np_dtype = np.uint64 if kind == "u8" else np.int64
    if isinstance(column, list):
        return _plain(column, kind, shape, where).reshape(shape)
    if not isinstance(column, dict) or column.get("packed") != kind:
        raise ManifestError(f"{where}: column must be a JSON array or a packed {kind} column")
    if column.get("shape") != list(shape):
        raise ManifestError(f"{where}: packed column has shape {column.get('shape')}, expected {list(shape)}")
    expected = 8 * math.prod(shape)
    try:
        raw = base64.b64decode(column["data"], validate=True)
        if column.get("zlib"):  # never inflate past the promised size: a small manifest is no zip bomb
            stream = zlib.decompressobj()
            raw = stream.decompress(raw, min(expected + 1, INT64_MAX))
            if not stream.eof:
                raise ValueError("the zlib stream is cut short or inflates past the column's shape")
        if len(raw) != expected:
            raise ValueError(f"{len(raw)} bytes where {expected} belong")
        flat = np.frombuffer(raw, dtype=_DTYPES[kind])
        if column.get("delta"):
            flat = np.cumsum(flat, dtype=flat.dtype)
        return flat.astype(np_dtype, copy=False).reshape(shape)
    except (KeyError, ValueError, zlib.error, TypeError) as exc:
        raise ManifestError(f"{where}: malformed packed column ({exc})") from None


def _plain(column: list, kind: str, shape: tuple, where: str) -> np.ndarray:
    """A JSON array column: ``shape`` exactly, every value a JSON integer that fits the kind.
    (numpy alone would take ``true`` for 1 and wrap 2**63 round to a negative number.)"""
    if len(shape) == 1:
        values = column
    elif all(isinstance(row, list) and len(row) == shape[1] for row in column):
        values = [v for row in column for v in row]
    else:
        values = None
    if values is None or len(column) != shape[0]:
        raise ManifestError(f"{where}: malformed column (expected shape {list(shape)})")
    if any(type(v) is not int for v in values):
        raise ManifestError(f"{where}: malformed column (values that are not integers)")
    low, high = (0, UINT64_MAX) if kind == "u8" else (-INT64_MAX - 1, INT64_MAX)
    if values and (min(values) < low or max(values) > high):
        raise ManifestError(f"{where}: malformed column (a value outside the 64-bit range {low}..{high})")
    return np.array(values, dtype=np.uint64 if kind == "u8" else np.int64)
