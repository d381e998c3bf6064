"""Column encodings of the manifest: plain JSON arrays, or packed binary for large tensors.

A tensor sharded over a thousand ranks has a thousand pieces; written as JSON numbers each piece
costs ~60 bytes and parsing a 70B-model manifest takes seconds. Columns of tensors with many pieces
are therefore packed: little-endian 64-bit integers, optionally delta-coded (offsets grow by
near-constant steps) and zlib-compressed, in base64. Checksums are random, so they are packed but
not compressed. Small tensors keep plain arrays, so ordinary manifests stay readable by eye.

Compression makes a zip bomb possible: a few bytes of zlib that inflate into gigabytes. A packed
column never inflates past the shape it declares, but the manifest declares the shapes, so that
alone bounds nothing. A parse therefore gives all packed columns of a manifest one budget,
``INFLATE_RATIO`` times the manifest's size (:class:`InflationBudget`), and the parser caps
each tensor's pieces at the number of ranks that saved it (``format/manifest.py``).
"""
from __future__ import annotations

import base64
import json
import math
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ManifestError

PACK_MIN_PIECES = 64
INT64_MAX, UINT64_MAX = (1 << 63) - 1, (1 << 64) - 1
_DTYPES = {"i8": "<i8", "u8": "<u8"}

# The packed columns of a manifest inflate to at most INFLATE_RATIO times the manifest's size in
# bytes. What statesnap writes stays far below, whatever the layout: every piece has at least one
# 8-byte checksum, stored uncompressed (10.7 bytes of base64), and inflates to 8 * (4 + 2d) bytes
# for d dimensions (+8 with a checksum_blocks column), and the start and size columns of tensors
# with more than PACK_ZLIB_MAX_DIMS dimensions are not compressed (base64 is 4/3 of the bytes): at
# most (32 + 16 * 8 + 8 + 8) / 10.67 = 16.5 times. The 1024-rank Llama-70B manifest of
# docs/format.md section 10 (25.3 MB, 1.79 M pieces) inflates 4.5 times.
INFLATE_RATIO = 64
PACK_ZLIB_MAX_DIMS = 8


class InflationBudget:
    """What the packed columns of one manifest may still inflate to, in bytes."""

    def __init__(self, manifest_bytes: int):
        self.limit = self.left = INFLATE_RATIO * manifest_bytes

    def take(self, nbytes: int, where: str) -> None:
        if nbytes > self.left:
            raise ManifestError(
                f"{where}: its packed column of {nbytes} bytes would take the manifest's packed columns "
                f"past {self.limit} bytes, {INFLATE_RATIO} times the manifest's own size; no manifest "
                "statesnap writes inflates that much, so it is refused as damaged or hostile")
        self.left -= nbytes


def parse_json(data: bytes | str) -> Any:
    """RFC 8259 JSON, as every other reader of a manifest parses it: Python's json module also
    takes the literals NaN, Infinity and -Infinity, and turns a number like 1e999 into inf.
    statesnap never writes either (plain data tags non-finite floats ``__ss_float``), and a
    non-finite number read from a manifest would make ``statesnap inspect --json`` print invalid JSON.
    A key given twice in one object is refused too: readers that keep the first and readers that
    keep the last would load different checkpoints from one file (docs/format.md §8)."""
    return on_a_fresh_stack_if_deep(_parse_json, data)


def _parse_json(data: bytes | str) -> Any:
    return json.loads(data, parse_constant=_refuse_literal, parse_float=_finite_float, object_pairs_hook=_unique_keys)


def on_a_fresh_stack_if_deep(parse: Callable[..., Any], *args: Any) -> Any:
    """``parse(*args)``, run again on a thread of its own where it ran out of Python's recursion
    limit: JSON and plain data nest by recursion, and how deep a value can be read must not
    depend on how deep in its own calls the caller is (an intact checkpoint read from 60 frames
    down was called damaged, and an older one loaded in its place). A RecursionError there too
    is the value's own depth, deeper than any statesnap writes (plaindata.MAX_NESTING)."""
    try:
        return parse(*args)
    except RecursionError:
        pass
    with ThreadPoolExecutor(1, thread_name_prefix="statesnap-deep-parse") as pool:
        return pool.submit(parse, *args).result()


def _unique_keys(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"the key {twice!r} appears twice in one object")
    return out


def _refuse_literal(literal: str):
    raise ValueError(f"{literal} is not a JSON value (RFC 8259)")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"the number {literal[:40]} is past the largest 64-bit float")
    return value


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


def shape_problem(shape: Sequence[int], itemsize: int) -> str | None:
    """Why no tensor can have ``shape`` (non-negative integers), or None: torch's limits. Its
    strides (in elements: the product of the extents after the first, an empty one counted as
    one) must fit 64 bits, so [0, 2**62, 2**62] holds no bytes and still cannot be made; a tensor
    with elements must hold at most 2**63 - 1 bytes. The product stops at the first factor past
    the limit: a made-up shape of tens of thousands of dimensions costs a pass over them, not a
    multiplication of ever larger numbers."""
    strides = 1
    for extent in shape[1:]:
        strides *= max(extent, 1)
        if strides > INT64_MAX:
            return "is too large for a tensor (its strides pass 2**63 - 1 elements)"
    if shape and 0 not in shape and shape[0] * strides * itemsize > INT64_MAX:
        return "is too large for a tensor (it holds more than 2**63 - 1 bytes)"
    return None


def shape_text(shape: Sequence[int]) -> str:
    """A shape for a message: in full when short, by its length when not."""
    return str(list(shape)) if len(shape) <= 8 else f"a shape of {len(shape)} dimensions"


def integer(value: Any, low: int = 0, high: int = INT64_MAX) -> int:
    """A manifest integer in ``[low, high]``: JSON numbers like 2.7 or true are malformed, not 2
    or 1, and a value past 64 bits is refused here instead of overflowing numpy further on."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    if not low <= value <= high:
        raise ValueError(f"{value} is outside {low}..{high}")
    return value


def unpack(column: Any, kind: str, shape: tuple, where: str, budget: InflationBudget | None = None) -> np.ndarray:
    """A column as a numpy array of ``shape`` (JSON list or packed form). Plain values are checked
    one by one (exact JSON integers in the kind's range); packed ones are 64-bit by construction.
    A packed column's ``8 * prod(shape)`` bytes are taken from ``budget`` before anything is
    decoded (without one, only the shape the caller expects bounds what it inflates to)."""
    np_dtype = np.uint64 if kind == "u8" else np.int64
    if isinstance(column, list):
        return _plain(column, kind, shape, where).reshape(shape)
    if not isinstance(column, dict) or column.get("packed") != kind:
        raise ManifestError(f"{where}: column must be a JSON array or a packed {kind} column")
    if column.get("shape") != list(shape):
        raise ManifestError(f"{where}: packed column has shape {column.get('shape')}, expected {list(shape)}")
    expected = 8 * math.prod(shape)
    if budget is not None:
        budget.take(expected, where)
    try:
        raw = base64.b64decode(column["data"], validate=True)
        if column.get("zlib"):  # never inflate past the promised size: a small manifest is no zip bomb
            raw = inflated(raw, min(expected + 1, INT64_MAX), "the column's shape")
        if len(raw) != expected:
            raise ValueError(f"{len(raw)} bytes where {expected} belong")
        flat = np.frombuffer(raw, dtype=_DTYPES[kind])
        if column.get("delta"):
            flat = np.cumsum(flat, dtype=flat.dtype)
        return flat.astype(np_dtype, copy=False).reshape(shape)
    except (KeyError, ValueError, zlib.error, TypeError) as exc:
        raise ManifestError(f"{where}: malformed packed column ({exc})") from None


def inflated(stream, limit: int, bound: str) -> bytes:
    """A whole zlib stream inflated to at most ``limit`` bytes: a ValueError where it is cut short,
    inflates past ``limit`` (``bound`` says what sets it), or has bytes after its end, which the
    format forbids (another reader would refuse what this one took)."""
    inflater = zlib.decompressobj()
    data = inflater.decompress(stream, limit)
    if not inflater.eof:
        raise ValueError(f"the zlib stream is cut short or inflates past {bound}")
    if inflater.unused_data:
        raise ValueError(f"{len(inflater.unused_data)} bytes follow the end of the zlib stream")
    return data


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
