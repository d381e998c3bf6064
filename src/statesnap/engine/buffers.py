"""Byte views of tensors: the one place tensors become buffers for the storage layer."""
from __future__ import annotations

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat writable byte view of a contiguous CPU tensor's memory (no copy)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("byte_view needs a contiguous CPU tensor")
    if t.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def host_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it is already a contiguous CPU tensor, else a contiguous CPU copy."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu", non_blocking=False).contiguous()
    return t if t.is_contiguous() else t.contiguous()
