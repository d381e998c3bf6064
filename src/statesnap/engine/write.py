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
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from ..format.checksum import checksum_blocks
from ..plan.save_plan import ALIGN
from ..storage.aligned import BOUNCE, BOUNCE_BYTES, address
from ..storage.base import FileWriter, StorageBackend

CHUNK_BLOCKS = 4
# Workers of a windowed write unless the caller says otherwise (at least this many, so that this
# many direct writes can be in flight): this VM's disk wrote 16 MiB O_DIRECT requests at about
# 2 GB/s with two to sixteen in flight (the io suite's raw_direct keeps four); they wait on the
# device, not the CPU.
DIRECT_DEPTH = 4

Job = tuple[int, memoryview]  # (file offset, bytes)


def default_threads() -> int:
    return max(2, min(8, os.cpu_count() or 2))


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

    # One task list in file order, so that checksums (CPU) run between window writes (device):
    # (offset, chunk number or -1 for a window, task)
    tasks: list[tuple[int, int, Callable[[], list[int] | None]]] = []
    for number, (_, offset, part) in enumerate(chunks):
        if windowed:
            tasks.append((offset, number, lambda part=part: checksum_blocks([part], block_bytes)))
        else:
            tasks.append((offset, number, lambda offset=offset, part=part: write_and_checksum(offset, part)))
    if windowed:
        for start, parts in _windows(jobs):
            tasks.append((start, -1, lambda start=start, parts=parts: _write_window(writer, start, parts, advance)))
        tasks.sort(key=lambda task: task[:2])
    try:
        workers = threads or (max(default_threads(), DIRECT_DEPTH) if windowed else default_threads())
        if workers == 1 or len(tasks) <= 1:
            results = [task() for _, _, task in tasks]
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="statesnap-write") as pool:
                results = list(pool.map(lambda task: task[2](), tasks))
    except BaseException:
        writer.close(durable=False)
        raise
    writer.close(durable)
    sums = {number: result for (_, number, _), result in zip(tasks, results) if number >= 0}
    out: list[list[int]] = [[] for _ in jobs]
    for number, (index, _, _) in enumerate(chunks):
        out[index].extend(sums[number])
    return out


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


def _write_window(writer: FileWriter, start: int, parts: list[Job], advance: Callable[[int], None]) -> None:
    """Copy the window's parts into an aligned buffer, zero the gaps between them, write it whole."""
    bounce = BOUNCE.take()
    try:
        base, filled = address(bounce), 0
        for pos, part in parts:
            if pos > filled:
                ctypes.memset(base + filled, 0, pos - filled)
            ctypes.memmove(base + pos, address(part), len(part))  # releases the GIL
            filled = pos + len(part)
        writer.pwrite_bulk(start, bounce[:filled])
    finally:
        BOUNCE.give(bounce)
    advance(sum(len(part) for _, part in parts))


__all__ = ["write_file", "default_threads"]
