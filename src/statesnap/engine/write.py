"""Writing one rank's data file: positioned writes from several threads, checksums on the way.

Large tensors are cut into block-aligned chunks so several threads write (and checksum) one
tensor at once. Buffered writes go from the tensor's own memory; durable ones go past the page
cache where the backend can (see ``FileWriter.pwrite_bulk``).
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from ..format.checksum import checksum_blocks
from ..plan.save_plan import ALIGN
from ..storage.base import StorageBackend

CHUNK_BLOCKS = 4


def default_threads() -> int:
    return max(2, min(8, os.cpu_count() or 2))


def write_file(backend: StorageBackend, path: str, jobs: Sequence[tuple[int, memoryview]],
               block_bytes: int, durable: bool, threads: int | None = None,
               advance: Callable[[int], None] = lambda nbytes: None) -> list[list[int]]:
    """Write ``(offset, bytes)`` jobs into ``path``; return each job's block checksums.
    ``advance(nbytes)`` is told of every chunk written (a progress bar)."""
    writer = backend.open_write(path, durable)
    # Whole blocks (each chunk checksums its own), starting on ALIGN like the pieces: a streaming
    # writer then knows a stream that ends off ALIGN ends a piece (see storage/fsspec_backend).
    chunk = math.lcm(block_bytes * CHUNK_BLOCKS, ALIGN)
    tasks = []  # (job index, chunk position, offset, view)
    for index, (offset, view) in enumerate(jobs):
        for pos in range(0, max(len(view), 1), chunk):
            tasks.append((index, pos, offset + pos, view[pos:pos + chunk]))

    def run(task):
        _, _, offset, view = task
        if durable:  # the disk must get the bytes anyway: in large requests, past the page cache
            writer.pwrite_bulk(offset, view)
        else:  # done once the bytes are in the page cache
            writer.pwrite(offset, [view])
        sums = checksum_blocks([view], block_bytes)
        advance(len(view))
        return sums

    try:
        if threads == 1 or len(tasks) <= 1:
            sums = [run(t) for t in tasks]
        else:
            with ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="statesnap-write") as pool:
                sums = list(pool.map(run, tasks))
    except BaseException:
        writer.close(durable=False)
        raise
    writer.close(durable)
    out: list[list[int]] = [[] for _ in jobs]
    for (index, _, _, _), chunk_sums in zip(tasks, sums):
        out[index].extend(chunk_sums)
    return out


__all__ = ["write_file", "default_threads"]
