"""Plain Python data as tagged JSON, so the manifest never needs pickle.

JSON alone loses tuples, non-string keys, NaN/inf, bytes and small tensors (RNG states). Each is
written as a one-key object whose key starts with ``__ss_``; everything else is ordinary JSON. Any
other object is not plain data and goes through pickle only when the caller allows it by name.
"""
from __future__ import annotations

import base64
import math
from typing import Any

import torch

from ..errors import ManifestError
from .dtypes import dtype_from_name, dtype_name

TAG = "__ss_"
# Inline tensors are for small state (RNG, counters); large tensors belong in data files.
MAX_INLINE_TENSOR_BYTES = 1 << 20


class NotPlainData(TypeError):
    pass


def inlinable(t: torch.Tensor) -> bool:
    """Small plain CPU tensors may live inside plain data (tagged JSON); others need data files."""
    return type(t) is torch.Tensor and t.device.type == "cpu" and t.numel() * t.element_size() <= MAX_INLINE_TENSOR_BYTES


def encode(value: Any) -> Any:
    """Encode ``value`` as JSON-compatible data; raise :class:`NotPlainData` if it is not plain."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {TAG + "float": repr(value)}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {TAG + "tuple": [encode(v) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith(TAG) for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {TAG + "dict": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {TAG + "bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {TAG + "dtype": dtype_name(value)}
    if isinstance(value, torch.Tensor) and inlinable(value):
        raw = value.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return {TAG + "tensor": {"dtype": dtype_name(value.dtype), "shape": list(value.shape),
                                 "data": base64.b64encode(raw).decode("ascii")}}
    raise NotPlainData(f"{type(value).__name__} is not plain data")


def decode(data: Any, where: str = "") -> Any:
    if isinstance(data, list):
        return [decode(v, where) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (key, inner), = data.items()
        if key.startswith(TAG):
            return _decode_tagged(key[len(TAG):], inner, where)
    return {k: decode(v, where) for k, v in data.items()}


def _decode_tagged(tag: str, inner: Any, where: str) -> Any:
    try:
        if tag == "float":
            return float(inner)
        if tag == "tuple":
            return tuple(decode(v, where) for v in inner)
        if tag == "dict":
            return {_hashable(decode(k, where)): decode(v, where) for k, v in inner}
        if tag == "bytes":
            return base64.b64decode(inner)
        if tag == "dtype":
            return dtype_from_name(inner, where)
        if tag == "tensor":
            dtype = dtype_from_name(inner["dtype"], where)
            raw = bytearray(base64.b64decode(inner["data"]))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(inner["shape"]).clone()
    except ManifestError:
        raise
    except Exception as exc:  # malformed tagged value: report where, never guess
        raise ManifestError(f"malformed {tag} value at {where or 'plain data'}: {exc}") from None
    raise ManifestError(f"unknown plain-data tag {TAG + tag!r} at {where or 'plain data'}")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
