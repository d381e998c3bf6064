"""Byte views of tensors: the one place tensors become buffers for the storage layer."""
from __future__ import annotations

import ctypes

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat writable byte view of a contiguous CPU tensor's memory (no copy). A tensor whose
    conjugate or negative bit is set is refused: its memory does not hold its values."""
    if not t.is_contiguous() or t.device.type != "cpu" or t.is_conj() or t.is_neg():
        raise ValueError("byte_view needs a contiguous CPU tensor without a conjugate or negative bit")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    # ctypes over the tensor's address costs a quarter of reshape/view/numpy, which a load of
    # many small tensors paid once per tensor
    buffer = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    buffer.owner = t  # the memory lives as long as the view
    return memoryview(buffer).cast("B")


def host_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it is a contiguous CPU tensor whose memory holds its values, else
    a contiguous CPU copy (a lazily conjugated or negated view is resolved)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu", non_blocking=False)
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t if t.is_contiguous() else t.contiguous()
