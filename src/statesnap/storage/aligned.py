"""Page-aligned buffers for direct I/O, kept across saves.

Direct I/O needs memory on a :data:`~statesnap.storage.base.DIRECT_ALIGN` boundary; tensors
rarely lie there, so their bytes are carried through these buffers. They are kept once made:
first-touching fresh memory costs more than the copy into it.
"""
from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np
import torch

from ..errors import CheckpointError
from .base import DIRECT_ALIGN

BOUNCE_BYTES = 16 << 20


def private_pages(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory of this process alone. ``mmap.mmap(-1, n)`` maps it shared,
    so a process forked afterwards (a DataLoader worker, a ``multiprocessing`` child) would write
    into the very pages its parent is writing to disk."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def pinned_pages(nbytes: int) -> torch.Tensor:
    """``nbytes`` of private page-locked host memory as a uint8 tensor, locked with cudaHostRegister
    for as long as the tensor lives.

    ``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which
    rounds the size up to a power of two (a 2.5 GB arena would lock 4 GB) and keeps the memory
    locked for the rest of the process once freed. Registering an ordinary allocation locks
    exactly what was asked, and only while it is used.
    """
    buffer = torch.frombuffer(private_pages(nbytes), dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 1)) != 0:  # 1: cudaHostRegisterPortable
        raise CheckpointError(f"could not pin {nbytes} bytes of host memory (cudaHostRegister failed); "
                              "lower host_memory_gb or raise the locked-memory limit (ulimit -l)")
    weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


def address(view: memoryview) -> int:
    """Where ``view``'s first byte lies in memory (0 for an empty view)."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


class BouncePool:
    """Buffers of :data:`BOUNCE_BYTES` plus one block of slack (so that a range may start at any
    distance from a block boundary, as ``storage/local.py`` places it), taken by one writer at a
    time and given back. At most ``keep`` are kept between saves; more writers at once (many
    threads) get buffers that are unmapped when given back."""

    def __init__(self, keep: int = 4):
        self._free: list[memoryview] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self) -> memoryview:
        with self._lock:
            if self._free:
                return self._free.pop()
        return memoryview(private_pages(BOUNCE_BYTES + DIRECT_ALIGN))

    def give(self, bounce: memoryview) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(bounce)
                return
        mapping = bounce.obj
        bounce.release()
        try:
            mapping.close()
        except BufferError:  # a slice of it is still alive: unmapped when that goes
            pass


BOUNCE = BouncePool()
