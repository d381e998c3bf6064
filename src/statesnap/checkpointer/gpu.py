"""The GPU path, kept apart because it cannot run on CPU-only machines.

At ``save()`` an event is recorded on each device's current (compute) stream; a side copy
stream waits on it, so the device-to-host copies see exactly the values of the moment of
``save()`` even though kernels queued before it may still be running. Copies go into the pinned
arena with ``non_blocking=True``; several copy workers keep several chunks in flight, and each
waits only for its own copy's completion event.
"""
from __future__ import annotations

import threading
import weakref

import torch

from ..errors import CheckpointError


def pin_in_place(buffer: torch.Tensor) -> None:
    """Page-lock ``buffer``'s memory with cudaHostRegister for as long as the tensor lives.

    ``torch.empty(..., pin_memory=True)`` goes through the caching host allocator, which rounds
    the size up to a power of two: a 2.5 GB arena would lock 4 GB. Registering an ordinary
    allocation locks exactly what the budget allows.
    """
    cudart = torch.cuda.cudart()
    ptr, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    if int(cudart.cudaHostRegister(ptr, nbytes, 1)) != 0:  # 1: cudaHostRegisterPortable
        raise CheckpointError(f"could not pin the {nbytes}-byte staging arena (cudaHostRegister failed); "
                              "lower host_memory_gb or raise the locked-memory limit (ulimit -l)")
    weakref.finalize(buffer, cudart.cudaHostUnregister, ptr)


def mark_devices(tensors) -> dict[int, "torch.cuda.Event"]:
    """One event per CUDA device in use, recorded on its current stream (call on the training thread)."""
    events = {}
    for t in tensors:
        if t.device.type == "cuda" and t.device.index not in events:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            events[t.device.index] = event
    return events


class CudaCopier:
    """Device-to-host copies on one side stream per device, ordered after the save() events."""

    def __init__(self):
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device.index not in self._streams:
                self._streams[device.index] = torch.cuda.Stream(device)
            return self._streams[device.index]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, offset: int, ready: "torch.cuda.Event") -> None:
        stream = self._stream(src.device)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            if src.is_contiguous():
                dst.copy_(src.reshape(-1).view(torch.uint8)[offset:offset + dst.numel()], non_blocking=True)
            else:
                dst.view(src.dtype).view(src.shape).copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
