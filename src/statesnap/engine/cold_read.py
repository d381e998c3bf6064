"""Reads of local files that take what the page cache holds and bring the rest with direct I/O.

A restore after a failure usually finds its files cold. Buffered reads of cold files cost the CPU
a page-cache fill and a copy out of it per byte; with the checksums and the other ranks' work on
the same cores, that CPU is what slowed them down here (1.4 GB/s from this VM's disk with the
cores idle, 0.3-0.9 GB/s with them busy, while ``O_DIRECT`` reads kept 1.4). So each read first
asks the page cache alone (``RWF_NOWAIT``: no I/O, no waiting), which is all a warm load needs,
and fetches what is missing with ``O_DIRECT`` into an aligned bounce buffer, copied from there
into the destination while it is still in the CPU's caches. The bounce buffers are the only
memory this adds: one per reading thread, freed when the load ends. Where ``O_DIRECT`` or
``RWF_NOWAIT`` is refused (tmpfs, some FUSE and network file systems) reads are plain buffered
ones.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from typing import Sequence

import numpy as np

from ..storage.base import DIRECT_ALIGN

BOUNCE_BYTES = 16 << 20  # one read request: what the disk's parallel ceiling was measured with
DIRECT_MIN = 1 << 20  # smaller reads go buffered: a direct request this small costs more than a copy
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _skip(views: Sequence[memoryview], nbytes: int) -> list[memoryview]:
    """``views`` without their first ``nbytes`` bytes."""
    out = []
    for view in views:
        if nbytes >= len(view):
            nbytes -= len(view)
            continue
        out.append(view[nbytes:])
        nbytes = 0
    return out


def _scatter(source: memoryview, views: Sequence[memoryview]) -> None:
    """Copy ``source`` into the concatenation of ``views`` from its start (memmove releases the GIL)."""
    pos = 0
    for view in views:
        if pos >= len(source):
            return
        take = min(len(view), len(source) - pos)
        ctypes.memmove(_address(view), _address(source[pos:pos + take]), take)
        pos += take


class ColdReads:
    """Positioned reads of local files by path, warm bytes from the page cache, cold ones direct."""

    def __init__(self):
        self._fds: dict[str, list[int]] = {}  # path -> [buffered fd, direct fd or -1]
        self._bounces: list[memoryview] = []
        self._lock = threading.Lock()
        self._nowait = bool(_NOWAIT)

    def readinto(self, path: str, offset: int, views: Sequence[memoryview]) -> int:
        """Fill ``views`` from ``offset`` of ``path``; returns the bytes read (short at the end of the file)."""
        views = [v for v in views if len(v)]
        want = sum(len(v) for v in views)
        fds = self._open(path)
        got = self._from_cache(fds[0], offset, views) if want >= DIRECT_MIN else 0
        while got < want and want >= DIRECT_MIN and fds[1] >= 0:
            n = self._direct(fds, offset + got, _skip(views, got))
            if n <= 0:
                break
            got += n
        while got < want:
            n = os.preadv(fds[0], _skip(views, got), offset + got)
            if n <= 0:
                break
            got += n
        return got

    def _open(self, path: str) -> list[int]:
        with self._lock:
            fds = self._fds.get(path)
            if fds is None:
                fds = [os.open(path, os.O_RDONLY), -1]
                self._fds[path] = fds  # before the direct open: close() sees the buffered fd either way
                if _O_DIRECT and self._nowait:
                    try:
                        fds[1] = os.open(path, os.O_RDONLY | _O_DIRECT)
                    except OSError:  # tmpfs and many FUSE file systems refuse O_DIRECT
                        pass
            return fds

    def _from_cache(self, fd: int, offset: int, views: list[memoryview]) -> int:
        """What the page cache holds from ``offset`` on, without waiting for the disk."""
        if not self._nowait:
            return 0
        got = 0
        while views:
            try:
                n = os.preadv(fd, views, offset + got, _NOWAIT)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self._nowait = False  # unknown cache state: every read goes buffered from now on
                break
            if n <= 0:
                break
            got += n
            views = _skip(views, n)
        return got

    def _direct(self, fds: list[int], offset: int, views: list[memoryview]) -> int:
        """One aligned ``O_DIRECT`` read of up to a bounce buffer, copied into ``views``."""
        bounce = self._take()
        try:
            start = offset // DIRECT_ALIGN * DIRECT_ALIGN
            end = offset + sum(len(v) for v in views)
            length = min(len(bounce), -(-(end - start) // DIRECT_ALIGN) * DIRECT_ALIGN)
            try:
                n = os.preadv(fds[1], [bounce[:length]], start)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(fds[1])  # the file system took O_DIRECT but not these reads
                fds[1] = -1
                return 0
            usable = min(n - (offset - start), end - offset)
            if usable <= 0:
                return 0
            _scatter(bounce[offset - start:offset - start + usable], views)
            return usable
        finally:
            with self._lock:
                self._bounces.append(bounce)

    def _take(self) -> memoryview:
        with self._lock:
            if self._bounces:
                return self._bounces.pop()
        return memoryview(mmap.mmap(-1, BOUNCE_BYTES))  # page-aligned, as O_DIRECT needs

    def close(self) -> None:
        with self._lock:
            for fds in self._fds.values():
                for fd in fds:
                    if fd >= 0:
                        os.close(fd)
            self._fds.clear()
            self._bounces.clear()
