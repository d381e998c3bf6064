"""Page-aligned buffers for direct I/O, kept across saves.

Direct I/O needs memory on a :data:`~statesnap.storage.base.DIRECT_ALIGN` boundary; tensors
rarely lie there, so their bytes are carried through these buffers. They are kept once made:
first-touching fresh memory costs more than the copy into it.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref

import numpy as np
import torch

from ..errors import CheckpointError
from .base import DIRECT_ALIGN

BOUNCE_BYTES = 16 << 20
HUGE_PAGE = 2 << 20


def private_pages(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory of this process alone, which no child inherits.

    * Private: ``mmap.mmap(-1, n)`` maps memory shared, so a process forked afterwards would
      write into the very pages its parent is writing to disk.
    * Not inherited (``MADV_DONTFORK``): a DataLoader forks its workers at every epoch. A child
      holding the staging arena's pages would make each of the parent's next writes there copy
      the page first, and keep the old copies: twice the arena's memory while workers live.
      The child still holds the Python object, whose release unmaps its range: an empty
      placeholder is mapped there in the child (:func:`_hold_in_child`), so that release never
      unmaps memory the child has put there meanwhile.
    * Transparent huge pages where the kernel gives them to regions that ask: these buffers live
      long and are filled whole, and faulting in 2 MiB pages instead of 4 KiB ones made
      first-touching 370 MB take 35 ms instead of 190 ms (median of 15 on this project's 2-core
      VM; three of the 15 waited 0.3-0.4 s for the kernel to compact memory).
    """
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _madvise(mapping, "MADV_DONTFORK"):
        start = np.frombuffer(mapping, dtype=np.uint8).ctypes.data  # the array, and its export, go at once
        with _unforked_lock:
            _unforked[id(mapping)] = (weakref.ref(mapping), start, nbytes)
        weakref.finalize(mapping, _unforked.pop, id(mapping), None)
    if nbytes >= HUGE_PAGE:
        _madvise(mapping, "MADV_HUGEPAGE")
    return mapping


def _madvise(mapping: mmap.mmap, option: str) -> bool:
    """Whether the kernel took the advice (one this Python or kernel lacks is skipped)."""
    if not hasattr(mmap, option):
        return False
    try:
        mapping.madvise(getattr(mmap, option))
        return True
    except OSError:
        return False


_unforked: dict[int, tuple[weakref.ref, int, int]] = {}  # id(mapping) -> (mapping, start, length)
_unforked_lock = threading.Lock()
# MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE (Linux): no memory, no clobbering
_PLACEHOLDER = 0x02 | 0x20 | 0x4000 | 0x100000


def _hold_in_child() -> None:
    """In a forked child: map an inaccessible, unbacked placeholder over every range of
    ``private_pages`` the parent held (the child has none of them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    for ref, start, length in list(_unforked.values()):
        mapping = ref()
        if mapping is not None and not mapping.closed:
            libc.mmap(start, length, 0, _PLACEHOLDER, -1, 0)  # PROT_NONE; fails harmlessly if taken


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_hold_in_child)


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

    def forget(self) -> None:
        """In a forked child: the buffers kept are the parent's, not mapped here (``private_pages``);
        start empty, with a lock no parent thread may have held at the fork."""
        self._free, self._lock = [], threading.Lock()

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
if hasattr(os, "register_at_fork"):  # after _hold_in_child: dropping the views unmaps the placeholders
    os.register_at_fork(after_in_child=BOUNCE.forget)
