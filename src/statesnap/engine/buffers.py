"""Byte views of tensors: the one place tensors become buffers for the storage layer."""
from __future__ import annotations

import ctypes
import functools

import torch

from ..format.dtypes import flat_bytes

# dtypes numpy has: their tensors become arrays directly, without the reshape and uint8 view the
# others need (4.8 -> 3.4 us per tensor)
_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.complex128, torch.complex64, torch.int64,
                 torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}
# ctypes' array type of each byte count, made once (borrowed_byte_view)
_bytes_type = functools.lru_cache(maxsize=1024)(lambda nbytes: ctypes.c_ubyte * nbytes)


def memory_in_order(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory, read in order, holds its values: contiguous, and no conjugate or
    negative bit (a lazily conjugated or negated view holds the values before that)."""
    return t.is_contiguous() and not (t.is_conj() or t.is_neg())


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat writable byte view of a contiguous CPU tensor's memory (no copy), which keeps that
    memory alive. A tensor whose conjugate or negative bit is set is refused (its memory does not
    hold its values), and so is one without memory of its own (a wrapper subclass)."""
    # (the cheapest of torch's attribute calls: a load of many small tensors makes one per tensor)
    if not t.is_cpu or not memory_in_order(t):
        raise ValueError("byte_view needs a contiguous CPU tensor without a conjugate or negative bit")
    if t.requires_grad:
        t = t.detach()
    if _has_no_bytes(t):
        return memoryview(bytearray(0))
    array = t.numpy() if t.dtype in _NUMPY_DTYPES else flat_bytes(t).numpy()
    return memoryview(array).cast("B")


def borrowed_byte_view(t: torch.Tensor) -> memoryview:
    """:func:`byte_view` of a tensor its caller knows to be a contiguous CPU tensor without a
    conjugate or negative bit (a load asks that of each target to route it), which does NOT keep
    the memory alive: the caller holds ``t`` for as long as it uses the view. It costs a third of
    :func:`byte_view` (no numpy array, no detached alias of a tensor that requires grad), which a
    load of many small tensors pays for each."""
    if _has_no_bytes(t):
        return memoryview(bytearray(0))
    return memoryview(_bytes_type(t.nbytes).from_address(t.data_ptr())).cast("B")


def _has_no_bytes(t: torch.Tensor) -> bool:
    """Whether ``t`` is empty; a ValueError where it has elements but no memory of its own."""
    if t.numel() == 0:
        return True
    if t.data_ptr() == 0:
        raise ValueError(f"a {type(t).__name__} has no memory of its own to read or write")
    return False


def host_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it is a contiguous CPU tensor whose memory holds its values, else
    a contiguous CPU copy (a lazily conjugated or negated view is resolved)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu", non_blocking=False)
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t if t.is_contiguous() else t.contiguous()
