"""Page-aligned buffers for direct I/O, kept across saves.

Direct I/O needs memory on a :data:`~statesnap.storage.base.DIRECT_ALIGN` boundary; tensors
rarely lie there, so their bytes are carried through these buffers. They are kept once made:
first-touching fresh memory costs more than the copy into it.
"""
from __future__ import annotations

import mmap
import os
import sys
import threading
import weakref

import numpy as np
import torch

from ..errors import CheckpointError
from .base import DIRECT_ALIGN

BOUNCE_BYTES = 16 << 20
# Bounce buffers kept between saves: a durable save's four direct writes in flight and two
# windows being filled meanwhile (engine/write.py)
KEPT_BOUNCES = 6
HUGE_PAGE = 2 << 20
_MADV_WIPEONFORK = getattr(mmap, "MADV_WIPEONFORK", 18 if sys.platform.startswith("linux") else None)  # not in 3.11


def private_pages(nbytes: int, huge: bool = False) -> mmap.mmap:
    """Page-aligned anonymous memory of this process alone, which a forked child sees zeroed.

    * Private: ``mmap.mmap(-1, n)`` maps memory shared, so a process forked afterwards would
      write into the very pages its parent is writing to disk.
    * Wiped in a child (``MADV_WIPEONFORK``, Linux 4.14+): a DataLoader forks its workers at
      every epoch. A child sharing these pages copy-on-write would make each of the parent's
      next writes there copy the page first, and keep the old copies: twice the arena's memory
      while workers live. The child gets zero-filled memory at the same address instead, its
      own, which its copies of statesnap's objects may use and release. (Older kernels refuse
      the advice and children share the pages copy-on-write, as before.)
    * ``huge``, for long-lived buffers (the staging arena, the bounce buffers kept between
      saves): transparent huge pages where the system gives them to regions that ask. Faulting
      in 2 MiB pages instead of 4 KiB ones made first-touching 370 MB take 35 ms instead of
      190 ms (median of 15 on this project's 2-core VM), but three of the 15 waited 0.3-0.4 s
      for the kernel to compact memory, so buffers made per load or pinned at once do not ask.
      Direct writes gain most: a disk request holds a bounded number of physically contiguous
      segments (254 here), and once a process has freed memory its fresh 4 KiB pages lie
      scattered, one segment each. 16 MiB direct writes from such pages went out as 512 KiB
      requests at 2.2-2.4 GB/s; from huge pages, as 4 MiB requests at 3.7-4.0 GB/s.
    """
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _madvise(mapping, _MADV_WIPEONFORK)
    if huge and nbytes >= HUGE_PAGE:
        _madvise(mapping, getattr(mmap, "MADV_HUGEPAGE", None))
    return mapping


def huge_aligned_pages(nbytes: int) -> memoryview:
    """``nbytes`` of :func:`private_pages` asking for huge pages, starting on a huge-page boundary.

    The kernel places a mapping whose length is no multiple of a huge page anywhere, and a
    16 MiB + 4 KiB bounce buffer (slack for a skewed range) began 1.1 MiB into one: each 16 MiB
    direct write then straddled nine huge pages and went out in 3.3 MiB requests on average
    instead of 4 MiB, writing 1 GB in 0.47-0.49 s against 0.42-0.44 s from aligned buffers (this
    project's 2-core VM, three rounds each; docs/benchmarks.md). Mapping one huge page more and
    starting at its boundary costs address space only: the pages before it are never touched."""
    view = memoryview(private_pages(nbytes + HUGE_PAGE, huge=True))
    skip = -address(view) % HUGE_PAGE
    return view[skip:skip + nbytes]


def _madvise(mapping: mmap.mmap, option: int | None) -> None:
    """Advice the kernel may not know (too old, another system): skipped."""
    if option is not None:
        try:
            mapping.madvise(option)
        except OSError:
            pass


def pinned_pages(nbytes: int) -> torch.Tensor:
    """``nbytes`` of private page-locked host memory as a uint8 tensor, locked with cudaHostRegister
    for as long as the tensor lives.

    ``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which
    rounds the size up to a power of two (a 2.5 GB arena would lock 4 GB) and keeps the memory
    locked for the rest of the process once freed. Registering an ordinary allocation locks
    exactly what was asked, and only while it is used.
    """
    buffer = torch.frombuffer(private_pages(nbytes), dtype=torch.uint8)
    lock_pages(buffer.data_ptr(), nbytes)
    weakref.finalize(buffer, unlock_pages, buffer.data_ptr())
    return buffer


def lock_pages(start: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` of host memory at address ``start`` for copies to and from devices
    (cudaHostRegister, portable: for every device). Runs at about 3 GB/s on an H200 machine."""
    if int(torch.cuda.cudart().cudaHostRegister(start, nbytes, 1)) != 0:  # 1: cudaHostRegisterPortable
        raise CheckpointError(f"could not pin {nbytes} bytes of host memory (cudaHostRegister failed); "
                              "lower host_memory_gb or raise the locked-memory limit (ulimit -l)")


def unlock_pages(start: int) -> None:
    """Undo :func:`lock_pages` of the memory locked from address ``start``."""
    torch.cuda.cudart().cudaHostUnregister(start)


def address(view: memoryview) -> int:
    """Where ``view``'s first byte lies in memory (0 for an empty view)."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


class BouncePool:
    """Buffers of :data:`BOUNCE_BYTES` plus one block of slack (so that a range may start at any
    distance from a block boundary, as ``storage/local.py`` places it), taken by one writer at a
    time and given back. At most ``keep`` are kept between saves; more writers at once (many
    threads) get buffers that are unmapped when given back."""

    def __init__(self, keep: int = KEPT_BOUNCES):
        self._free: list[memoryview] = []
        self._lent = 0
        self._keep = keep
        self._lock = threading.Lock()

    def after_fork(self) -> None:
        """In a forked child: a lock no parent thread may have held at the fork (the buffers
        kept are the child's own, zeroed: ``private_pages``); the parent's buffers in use are
        not the child's to give back."""
        self._lock = threading.Lock()
        self._lent = 0

    def take(self) -> memoryview:
        with self._lock:
            self._lent += 1
            if self._free:
                return self._free.pop()
            kept = self._lent <= self._keep  # huge pages for the buffers that will be kept only
        nbytes = BOUNCE_BYTES + DIRECT_ALIGN
        return huge_aligned_pages(nbytes) if kept else memoryview(private_pages(nbytes))

    def give(self, bounce: memoryview) -> None:
        with self._lock:
            self._lent -= 1
            if len(self._free) < self._keep:
                self._free.append(bounce)
                return
        unmap(bounce)


def unmap(view: memoryview) -> None:
    """Release ``view`` of :func:`private_pages` memory and unmap that memory now, unless another
    memoryview of it is still alive (then it is unmapped when that goes). A tensor made over it
    with ``torch.frombuffer`` holds no such view: never unmap memory a tensor may still use."""
    mapping = view.obj
    view.release()
    try:
        mapping.close()
    except BufferError:
        pass


BOUNCE = BouncePool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=BOUNCE.after_fork)
