"""Writing one rank's data file: positioned writes from several threads, checksums on the way.

Large tensors are cut into block-aligned chunks so several threads checksum (and, buffered, write)
one tensor at once. Buffered writes go from the tensor's own memory. Durable ones go past the page
cache where the backend can: the file is laid out in page-aligned windows (a copy of every byte,
which direct I/O needs anyway for memory that does not lie on a block boundary) and each window is
written whole, so the device gets large aligned requests and nothing is left in the page cache
for the final fsync.
"""
from __future__ import annotations

import ctypes
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from ..format.checksum import checksum_blocks
from ..plan.save_plan import ALIGN
from ..storage.aligned import BOUNCE, BOUNCE_BYTES, KEPT_BOUNCES, address
from ..storage.base import FileWriter, StorageBackend

CHUNK_BLOCKS = 4
# Threads of a windowed write that only wait on the device, so that this many direct writes are
# in flight: this VM's disk wrote 16 MiB O_DIRECT requests as fast with two to sixteen in flight
# (the io suite's raw_direct keeps four).
DIRECT_DEPTH = 4

Job = tuple[int, memoryview]  # (file offset, bytes)


def default_threads() -> int:
    return max(2, min(8, os.cpu_count() or 2))


def copy_threads() -> int:
    """Threads that copy and checksum a windowed write's bytes: half the cores. The other half
    is left to the direct writes' system calls and completions; on this project's 2-core VM,
    two copying threads kept the disk waiting for them (1 GB saved in 0.50 s, median of 9,
    against 0.44 s with one, as fast as the io suite's raw_direct ceiling)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def write_file(backend: StorageBackend, path: str, jobs: Sequence[Job], block_bytes: int, durable: bool,
               threads: int | None = None, advance: Callable[[int], None] = lambda nbytes: None,
               whole_file: bool = False) -> list[list[int]]:
    """Write ``(offset, bytes)`` jobs into ``path``; return each job's block checksums.
    ``advance(nbytes)`` is told of the bytes of every chunk or window written (a progress bar).
    ``whole_file``: the jobs are all the file holds and the bytes between them read as zeros, so
    a durable write may lay the file out in windows (which write those bytes too)."""
    writer = backend.open_write(path, durable)
    windowed = durable and whole_file and writer.bypasses_cache()
    # Whole blocks (each chunk checksums its own), starting on ALIGN like the pieces: a streaming
    # writer then knows a stream that ends off ALIGN ends a piece (see storage/fsspec_backend).
    chunk = math.lcm(block_bytes * CHUNK_BLOCKS, ALIGN)
    chunks = [(index, offset + pos, view[pos:pos + chunk])
              for index, (offset, view) in enumerate(jobs) for pos in range(0, max(len(view), 1), chunk)]

    def write_and_checksum(offset: int, part: memoryview) -> list[int]:
        writer.pwrite(offset, [part])
        advance(len(part))
        return checksum_blocks([part], block_bytes)

    try:
        if windowed:
            results = _checksum_and_write_windows(writer, jobs, chunks, block_bytes, threads or copy_threads(),
                                                  advance)
        else:
            tasks = [lambda offset=offset, part=part: write_and_checksum(offset, part) for _, offset, part in chunks]
            results = _run_all(tasks, threads or default_threads())
    except BaseException:
        writer.close(durable=False)
        raise
    writer.close(durable)
    out: list[list[int]] = [[] for _ in jobs]
    for (index, _, _), sums in zip(chunks, results):
        out[index].extend(sums)
    return out


def _run_all(tasks: list[Callable], workers: int) -> list:
    if workers == 1 or len(tasks) <= 1:
        return [task() for task in tasks]
    with ThreadPoolExecutor(workers, thread_name_prefix="statesnap-write") as pool:
        return list(pool.map(lambda task: task(), tasks))


def _checksum_and_write_windows(writer: FileWriter, jobs: Sequence[Job], chunks: list, block_bytes: int,
                                workers: int, advance: Callable[[int], None]) -> list[list[int]]:
    """Checksum every chunk and write the file as windows: ``workers`` threads checksum chunks
    and copy windows into bounce buffers in file order, and hand each filled window to
    :class:`_WindowWrites`. Returns (or raises) only once no write is left running, even
    through Ctrl-C, so that the caller may close the writer."""
    writes = _WindowWrites(writer, advance)
    # (offset, chunk number or -1 for a window, task), in file order: checksums (CPU) run
    # between window copies, and windows are filled in the order they are written
    tasks: list[tuple[int, int, Callable[[], list[int] | None]]] = [
        (offset, number, lambda part=part: None if writes.failed else checksum_blocks([part], block_bytes))
        for number, (_, offset, part) in enumerate(chunks)]
    tasks += [(start, -1, lambda start=start, parts=parts: writes.fill(start, parts))
              for start, parts in _windows(jobs)]
    tasks.sort(key=lambda task: task[:2])
    try:
        results = _run_all([task for _, _, task in tasks], workers)
    finally:
        writes.finish()
    sums = {number: result for (_, number, _), result in zip(tasks, results) if number >= 0}
    return [sums[number] for number in range(len(chunks))]


class _WindowWrites:
    """Filled windows written by :data:`DIRECT_DEPTH` threads that only wait on the device. When
    the threads that copied a window also wrote it, the copy was time without a write in flight.
    At most :data:`~statesnap.storage.aligned.KEPT_BOUNCES` windows are being filled or written
    at once: the buffers the pool keeps between saves. Once a write fails, no more windows are
    copied or written."""

    def __init__(self, writer: FileWriter, advance: Callable[[int], None]):
        self._writer, self._advance = writer, advance
        self._slots = threading.Semaphore(KEPT_BOUNCES)
        self._device = ThreadPoolExecutor(DIRECT_DEPTH, thread_name_prefix="statesnap-direct")
        self._pending = 0  # windows handed to the device threads and not yet done with
        self._idle = threading.Condition()
        self.failed: list[BaseException] = []  # the first is raised by finish()

    def fill(self, start: int, parts: list[Job]) -> None:
        """Copy the window's parts into a bounce buffer and queue its write (a worker's task)."""
        self._slots.acquire()
        if self.failed:
            self._slots.release()
            return
        try:
            bounce, filled = _filled_window(parts)
        except BaseException:
            self._slots.release()
            raise
        with self._idle:
            self._pending += 1
        try:
            self._device.submit(self._write, start, bounce, filled, sum(len(part) for _, part in parts))
        except BaseException:  # the device threads were stopped: an interrupted save
            self._done(bounce)
            raise

    def _write(self, start: int, bounce: memoryview, filled: int, nbytes: int) -> None:
        try:
            if not self.failed:
                self._writer.pwrite_bulk(start, bounce[:filled])
                self._advance(nbytes)
        except BaseException as exc:
            self.failed.append(exc)
        finally:
            self._done(bounce)

    def _done(self, bounce: memoryview) -> None:
        BOUNCE.give(bounce)
        self._slots.release()
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def finish(self) -> None:
        """Take no more windows and wait until none is being written, even when Ctrl-C
        interrupts the wait (then re-raised): no write may outlive the descriptor it writes
        through. A copying thread an interrupt left running can queue nothing after this.
        (Waiting by joining the threads would not do: on Python 3.11 a join that Ctrl-C
        interrupts marks a thread that is still running as stopped.) Raises the first failed
        write."""
        interrupted = None
        while True:
            try:
                self._device.shutdown(wait=False)
                with self._idle:
                    self._idle.wait_for(lambda: self._pending == 0)
                break
            except KeyboardInterrupt as exc:
                interrupted = exc
        if interrupted is not None:
            raise interrupted
        if self.failed:
            raise self.failed[0]


def _windows(jobs: Sequence[Job]) -> list[tuple[int, list[Job]]]:
    """The file cut into consecutive windows of ``BOUNCE_BYTES`` (the last one shorter), each with
    the parts of the jobs that fall into it as ``(position in the window, bytes)``."""
    windows: dict[int, list[Job]] = {}
    for offset, view in sorted(jobs, key=lambda job: job[0]):
        pos = 0
        while pos < len(view):
            start = (offset + pos) // BOUNCE_BYTES * BOUNCE_BYTES
            take = min(len(view) - pos, start + BOUNCE_BYTES - offset - pos)
            windows.setdefault(start, []).append((offset + pos - start, view[pos:pos + take]))
            pos += take
    return sorted(windows.items())


def _filled_window(parts: list[Job]) -> tuple[memoryview, int]:
    """A bounce buffer holding the window's parts, the gaps between them zeroed, and its length."""
    bounce = BOUNCE.take()
    try:
        base, filled = address(bounce), 0
        for pos, part in parts:
            if pos > filled:
                ctypes.memset(base + filled, 0, pos - filled)
            ctypes.memmove(base + pos, address(part), len(part))  # releases the GIL
            filled = pos + len(part)
    except BaseException:
        BOUNCE.give(bounce)
        raise
    return bounce, filled


__all__ = ["write_file", "default_threads"]
