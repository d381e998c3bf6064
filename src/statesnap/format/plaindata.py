"""Plain Python data as tagged JSON, so the manifest never needs pickle.

JSON alone loses tuples, non-string keys, NaN/inf, bytes and small tensors (RNG states). Each is
written as a one-key object whose key starts with ``__ss_``; everything else is ordinary JSON. Any
other object is not plain data and goes through pickle only when the caller allows it by name.
"""
from __future__ import annotations

import base64
import math
import re
import struct
from typing import Any

import torch

from ..errors import ManifestError
from .columns import on_a_fresh_stack_if_deep, shape_problem, shape_text
from .dtypes import DTYPE_TO_NAME, dtype_from_name, dtype_name, flat_bytes

TAG = "__ss_"
# Inline tensors are for small state (RNG, counters); large tensors belong in data files.
MAX_INLINE_TENSOR_BYTES = 1 << 20


class NotPlainData(TypeError):
    pass


# Readers refuse an integer literal of more digits than Python converts by default (docs/format.md
# §8, rule 1), so a writer must not write one, whatever limit its own process set.
MAX_INT_DIGITS = 4300
_INT_LIMIT = 10 ** MAX_INT_DIGITS
_INT_FLOOR = -_INT_LIMIT


def int_too_long(value: int) -> str | None:
    """Why ``value`` cannot be a JSON integer of the manifest, or None."""
    if _INT_FLOOR < value < _INT_LIMIT:
        return None
    return (f"an int of more than {MAX_INT_DIGITS} digits ({value.bit_length()} bits), longer than JSON readers "
            "take")


def inlinable(t: torch.Tensor) -> bool:
    """Small plain CPU tensors may live inside plain data (tagged JSON); others need data files.
    Sparse and nested tensors are not plain: their bytes are not one strided block. Nor is a
    dtype the format does not name (a quantized tensor): walked as a tensor, it is refused by
    name (state/items.py) rather than by a bare dtype error from deep in the encoder."""
    return (type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided and not t.is_nested
            and t.dtype in DTYPE_TO_NAME and t.numel() * t.element_size() <= MAX_INLINE_TENSOR_BYTES)


# Lists, tuples and dicts inside one another, at most: a reader nests by recursion (JSON's parser,
# then decode, three frames a level), and must be able to read whatever was written. Python's
# recursion limit made the limit before: what a save deep in its caller's calls could still write,
# which a reader from a deeper stack could not read back.
MAX_NESTING = 100


def encode(value: Any, depth: int = 0) -> Any:
    """Encode ``value`` as JSON-compatible data; raise :class:`NotPlainData` if it is not plain.
    ``depth``: the containers around it."""
    if value is None or isinstance(value, bool) or type(value) is str:
        return value
    if type(value) is int:
        if _INT_FLOOR < value < _INT_LIMIT:  # (inline: a list of a million ints passes here)
            return value
        raise NotPlainData(int_too_long(value))
    if type(value) is float:
        return value if math.isfinite(value) else {TAG + "float": _non_finite(value)}
    if isinstance(value, (int, float, str)):
        # A subclass (numpy's float64, an IntEnum, a StrEnum) is written as the plain value it
        # holds, which every level gives back alike: its own repr wrote np.float64(inf) as a tag
        # no reader takes, and a restore from host memory gave back the subclass.
        return encode(int.__int__(value) if isinstance(value, int) else
                      float.__float__(value) if isinstance(value, float) else str.__str__(value))
    if isinstance(value, (list, tuple, dict)):
        if depth >= MAX_NESTING:
            raise NotPlainData(f"it nests lists, tuples and dicts more than {MAX_NESTING} levels deep (store such "
                               "a value flatter, e.g. as a JSON string)")
        depth += 1
    if isinstance(value, list):
        return [encode(v, depth) for v in value]
    if isinstance(value, tuple):
        return {TAG + "tuple": [encode(v, depth) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith(TAG) for k in value):  # (a StrEnum key as the str it holds)
            return {str.__str__(k): encode(v, depth) for k, v in value.items()}
        return {TAG + "dict": [[encode(k, depth), encode(v, depth)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {TAG + "bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, torch.dtype):
        if value not in DTYPE_TO_NAME:
            raise NotPlainData(f"{value} is a dtype the statesnap format does not name")
        return {TAG + "dtype": dtype_name(value)}
    if isinstance(value, torch.Tensor) and inlinable(value):
        raw = flat_bytes(value.detach().resolve_conj().resolve_neg().contiguous()).numpy().tobytes()
        return {TAG + "tensor": {"dtype": dtype_name(value.dtype), "shape": list(value.shape),
                                 "data": base64.b64encode(raw).decode("ascii")}}
    if type(value) is torch.Tensor and value.layout == torch.strided and not value.is_nested and value.is_cpu \
            and value.dtype in DTYPE_TO_NAME:  # (inlinable but for its size)
        raise NotPlainData(f"a tensor of {value.numel() * value.element_size():,} bytes is more than plain data holds "
                           f"inline ({MAX_INLINE_TENSOR_BYTES:,} bytes: a tensor inside ss.PerRank, or in a value "
                           "saved whole)")
    raise NotPlainData(f"{type(value).__name__} is not plain data")


def decode(data: Any, where: str = "", manifest: str = "") -> Any:
    """The value ``encode`` gave ``data`` for. Anything ``encode`` never writes is refused with a
    ManifestError saying where (the value's name, and the ``manifest`` it was read from), never
    guessed at (docs/format.md §6)."""
    try:
        return on_a_fresh_stack_if_deep(_decode, data, where)
    except RecursionError:
        problem = f"plain data at {where or 'plain data'} is nested too deeply to read"
    except ManifestError as exc:
        if not manifest:
            raise
        problem = str(exc)
    raise ManifestError(f"{manifest}: {problem}" if manifest else problem) from None


def _decode(data: Any, where: str) -> Any:
    if isinstance(data, list):
        return [_decode(v, where) for v in data]
    if not isinstance(data, dict):
        return data
    if any(key.startswith(TAG) for key in data):
        if len(data) != 1:  # (encode writes a mapping with such keys as a tagged dict)
            raise ManifestError(f"malformed plain data at {where or 'plain data'}: an object with a "
                                f"{TAG}... key beside others")
        (key, inner), = data.items()
        return _decode_tagged(key[len(TAG):], inner, where)
    return {k: _decode(v, where) for k, v in data.items()}


_NON_FINITE = {"nan", "inf", "-inf"}
QUIET_NAN_BITS = 0x7FF8000000000000  # math.nan's bits; "nan" is read back as them
_NAN_BITS = re.compile(r"nan:[0-9a-f]{16}")


def float_bits(value: float) -> int:
    """The 64 bits of a float (a NaN's sign and payload included)."""
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def _non_finite(value: float) -> str:
    """The tag text of an infinity or a NaN. A NaN other than math.nan's bits (``inf - inf`` is
    -nan on x86; a payload) is written by its bits, so that a load gives it back bit for bit."""
    if not math.isnan(value) or float_bits(value) == QUIET_NAN_BITS:
        return repr(value)
    return f"nan:{float_bits(value):016x}"


# What statesnap wrote for numpy's non-finite float64 (its repr under numpy 2) before it wrote
# subclasses as plain floats: such checkpoints committed, and load.
_NUMPY_REPRS = {f"np.float64({text})": text for text in _NON_FINITE}


def _read_non_finite(text: Any) -> float:
    """The float ``_non_finite`` wrote ``text`` for; anything else is a ValueError."""
    if isinstance(text, str) and (text in _NON_FINITE or text in _NUMPY_REPRS):
        return float(_NUMPY_REPRS.get(text, text))  # (a new NaN each: a dict may hold two NaN keys, two objects)
    if isinstance(text, str) and _NAN_BITS.fullmatch(text):
        value = struct.unpack("<d", struct.pack("<Q", int(text[4:], 16)))[0]
        if math.isnan(value) and float_bits(value) != QUIET_NAN_BITS:  # (that one is written "nan")
            return value
    raise ValueError("only 'nan', 'inf', '-inf' and a NaN's bits ('nan:' and 16 hex digits) are tagged")


def _decode_tagged(tag: str, inner: Any, where: str) -> Any:
    def expect(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(what)
    try:
        if tag == "float":
            return _read_non_finite(inner)
        if tag == "tuple":
            expect(isinstance(inner, list), "a list of its elements is expected")
            return tuple(_decode(v, where) for v in inner)
        if tag == "dict":
            expect(isinstance(inner, list) and all(isinstance(p, list) and len(p) == 2 for p in inner),
                   "a list of [key, value] pairs is expected")
            out = {}
            for k, v in inner:
                key = _decode(k, where)
                hash(key)  # a list where encode wrote a hashable key is malformed (TypeError)
                # (no dict holds two equal keys: which value to keep would be a guess, as for JSON's own)
                expect(key not in out, f"the key {key!r} is given twice")
                out[key] = _decode(v, where)
            return out
        if tag == "bytes":
            expect(isinstance(inner, str), "base64 text is expected")
            return base64.b64decode(inner, validate=True)
        if tag == "dtype":
            return dtype_from_name(inner, where)
        if tag == "tensor":
            return _decode_tensor(inner, where, expect)
    except (ManifestError, RecursionError):  # (the recursion: out of stack, no damage; decode says which)
        raise
    except Exception as exc:  # malformed tagged value: report where, never guess
        raise ManifestError(f"malformed {tag} value at {where or 'plain data'}: {exc}") from None
    raise ManifestError(f"unknown plain-data tag {TAG + tag!r} at {where or 'plain data'}")


def _decode_tensor(inner: Any, where: str, expect) -> torch.Tensor:
    expect(isinstance(inner, dict) and set(inner) == {"dtype", "shape", "data"}, "dtype, shape and data are expected")
    dtype = dtype_from_name(inner["dtype"], where)
    shape = inner["shape"]
    expect(isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape), "a shape of sizes is expected")
    problem = shape_problem(shape, dtype.itemsize)  # (an empty one too: [0, 2**62, 2**62] is no tensor)
    if problem is not None:
        raise ValueError(f"{shape_text(shape)} {problem}")
    expect(isinstance(inner["data"], str), "base64 text is expected")
    raw = bytearray(base64.b64decode(inner["data"], validate=True))
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{len(raw)} bytes for a {dtype_name(dtype)} of shape {shape_text(shape)}")
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).clone()
