"""Loading into GPU tensors: verified reads into pinned host memory, copies to the device behind them.

Filling a GPU target the way a CPU one is filled would need a host buffer per tensor: copying
the target to the host to get one, keeping a host copy of every GPU tensor until the end (a
second copy of the state), and copying back from pageable memory, which the driver stages once
more. Instead the GPU targets are taken in waves of about ``WAVE_BYTES``: each wave is read and
verified straight into a pinned staging ring, then copied to its device on a side stream without
waiting. The read threads are shared by two waves at a time, so they go on to the next wave's
reads while the last reads of one finish, and the copies run behind the reads. A contiguous
target larger than a wave is loaded in parts (:func:`wave_parts`): locking fresh memory with
``cudaHostRegister`` runs at about 3 GB/s (a 768 MiB ring took 0.25-0.37 s on an H200 machine),
which a ring sized for the largest tensor paid at every load. The ring holds the largest part
(a wave or a checksum block; a strided target, or a row larger than that, whole) plus two
waves, locked for the load alone: that, and a read thread's scratch for a piece that cannot be
read in place, bound the extra host memory whatever the size of the state. Reads need no locked
memory, only the copies to a device do, so the ring is locked a segment at a time
(:func:`_ring_segments`) when a wave's copies first need it (:class:`_SegmentLocks`), after the
reads into it have faulted its pages in; locked at once before the reads, the 384 MiB ring of a
load of 4 GB had kept every read waiting about 0.13 s. Targets that the
checkpoint covers only in part (``strict=False``) go the CPU way (``load.py``), which leaves what
it does not cover as it was.
"""
from __future__ import annotations

import bisect
import itertools
import math
import mmap
import threading
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

import torch

from ..format.manifest import FLAT, TensorEntry
from ..plan.load_plan import TargetPlan, plan_target
from ..state.items import TensorItem
from ..storage.aligned import lock_pages, private_pages, unlock_pages
from ..storage.base import DIRECT_ALIGN
from .read import ReadExecutor

WAVE_BYTES = 128 << 20  # a wave keeps every read thread busy; a few fit the ring


class _SegmentLocks:
    """Page-locks the segments of memory from ``start`` to each of ``ends`` when a copy first
    needs them (:meth:`need`), with ``device`` current; :meth:`close` unlocks.

    Locked when needed, a segment's pages have been faulted in by the reads into it, several
    threads at once: locking memory already touched ran at 16-23 GB/s on an H200 machine, fresh
    memory at about 3 GB/s (the lock faults it in, page by page, on one thread). A copy whose
    host memory spans two segments fails (``cudaErrorInvalidValue``: the driver takes separately
    locked ranges as separate allocations), so the ring never places a slot across a segment's
    end (:meth:`PinnedRing.take`)."""

    def __init__(self, start: int, ends: list[int], device: torch.device):
        self._start, self._ends, self._device = start, ends, device
        self._locked: dict[int, int] = {}  # segment index -> its address
        self._mutex = threading.Lock()

    def need(self, start: int, nbytes: int) -> None:
        """Lock every segment that bytes ``start`` to ``start + nbytes`` lie in; raise why one cannot be."""
        if nbytes <= 0:
            return
        first, last = bisect.bisect_right(self._ends, start), bisect.bisect_right(self._ends, start + nbytes - 1)
        with self._mutex, torch.cuda.device(self._device):  # not a context on another GPU of the node
            for index in range(first, last + 1):
                if index not in self._locked:
                    low = self._ends[index - 1] if index else 0
                    lock_pages(self._start + low, self._ends[index] - low)
                    self._locked[index] = self._start + low

    def close(self) -> None:
        """Unlock what is locked; only once no copy uses the memory."""
        with self._mutex, torch.cuda.device(self._device):
            while self._locked:
                unlock_pages(self._locked.popitem()[1])


class PinnedRing:
    """Staging space in segments ending at ``ends`` (the last is the capacity), handed out in ring
    order and reclaimed in the same order: each slot is held with a function that returns once
    nothing uses the slot any more, and no slot crosses a segment's end. ``device``: each segment
    is page-locked (for every device) when a copy first needs it, with that device current;
    ``None``: not locked."""

    def __init__(self, ends: list[int], device: torch.device | None = None):
        self.ends = ends
        self.capacity = ends[-1]
        # exactly this much memory, locked behind the first waves' reads, unlocked by close()
        self.buffer = torch.frombuffer(private_pages(self.capacity), dtype=torch.uint8)
        self._locks = self._unlock = None
        if device is not None:
            self._locks = _SegmentLocks(self.buffer.data_ptr(), ends, device)
            # a ring dropped without close() unlocks too, before its memory is unmapped
            self._unlock = weakref.finalize(self, self._locks.close)
        self._held: deque[tuple[int, int, Callable[[], None]]] = deque()  # (start, end, release), oldest first
        self._head = 0

    def lock(self, start: int, nbytes: int) -> None:
        """Page-lock the segments ``nbytes`` from ``start`` lie in, if not yet locked."""
        if self._locks is not None:
            self._locks.need(start, nbytes)

    def close(self) -> None:
        """Unlock the memory: only once every copy out of it has finished."""
        if self._unlock is not None:
            self._unlock()

    def take(self, nbytes: int) -> int:
        """The start of ``nbytes`` free bytes, releasing the oldest slots until they are free."""
        start = self._next_start(nbytes)
        while self._held and any(s < start + nbytes and start < e for s, e, _ in self._held):
            self._held.popleft()[2]()
        self._head = start + nbytes
        return start

    def _next_start(self, nbytes: int) -> int:
        """The head, if the slot fits in the head's segment (a head on a segment's end begins the
        next one); else the start of the next segment, in ring order, large enough."""
        ends, index = self.ends, bisect.bisect_right(self.ends, self._head)
        if index < len(ends) and self._head + nbytes <= ends[index]:
            return self._head
        for i in [*range(index + 1, len(ends)), *range(min(index + 1, len(ends)))]:
            start = ends[i - 1] if i else 0
            if ends[i] - start >= nbytes:
                return start
        raise ValueError(f"no segment of the ring holds {nbytes} bytes")

    def hold(self, start: int, nbytes: int, release: Callable[[], None]) -> None:
        self._held.append((start, start + nbytes, release))

    def drain(self) -> None:
        while self._held:
            self._held.popleft()[2]()


class _Wave:
    """One wave: its reads into a ring slot, queued on the shared pool, then its device copies."""

    def __init__(self, targets: list, sizes: list[int], ring: PinnedRing, executor: ReadExecutor,
                 pool: ThreadPoolExecutor, streams: dict):
        self.executor, self.nbytes, self.streams, self.ring = executor, sum(sizes), streams, ring
        self.start = ring.take(self.nbytes)
        self.staged, pos = [], self.start
        for (fqn, entry, local, plan), size in zip(targets, sizes):
            host = ring.buffer[pos:pos + local.numel() * local.element_size()].view(local.dtype).view(local.shape)
            executor.add(fqn, entry, host, plan)
            self.staged.append((local, host))
            pos += size
        self.reads = executor.submit(pool)
        self.events: list | None = None
        ring.hold(self.start, self.nbytes, self.release)

    def copy_to_devices(self) -> None:
        """Wait for the reads and checksums (nothing reaches a device unless it verified), then
        queue the copies without waiting for them. Once."""
        if self.events is not None:
            return
        try:
            for future in self.reads:
                future.result()
        except BaseException:
            for future in self.reads:  # the wave failed: start none of its other reads...
                future.cancel()
            raise
        finally:
            wait(self.reads)  # ...and close its files only once no read uses them
            self.executor.close()
        self.ring.lock(self.start, self.nbytes)  # after the reads, which faulted its pages in
        used = {}
        with torch.no_grad():
            for local, host in self.staged:
                with torch.cuda.stream(self.streams[local.device]):
                    local.copy_(host, non_blocking=True)
                used[local.device] = self.streams[local.device]
        self.events = [stream.record_event() for stream in used.values()]

    def release(self) -> None:
        """Free the slot: wait for the copies (finishing the reads first when the ring is too small
        to hold this wave and the next, which happens only with parts larger than two waves)."""
        self.copy_to_devices()
        for event in self.events:
            event.synchronize()


def wave_parts(item: TensorItem, entry: TensorEntry, plan: TargetPlan, block_bytes: int) -> list[tuple]:
    """``item``'s target as (fqn, entry, tensor, plan) parts of about a wave each, or whole where
    it is no larger or strided: whole rows of a box, element ranges of a flat shard. A part is
    never smaller than a checksum block. Where a row's size allows it, parts of a tensor stored
    whole end on block boundaries; elsewhere (odd row sizes, a shard starting inside a stored
    piece) the block a boundary falls in is read, and verified, by both parts beside it."""
    local = item.local
    nbytes = local.numel() * local.element_size()
    part_bytes = max(WAVE_BYTES, block_bytes)
    if nbytes <= part_bytes or local.dim() == 0 or not local.is_contiguous():
        return [(item.fqn, entry, local, plan)]
    rows = local.view(-1) if item.layout == FLAT else local
    row_bytes = nbytes // len(rows)
    rows_per_block = block_bytes // math.gcd(row_bytes, block_bytes)  # fewest rows that end on a block
    step = max(1, part_bytes // row_bytes)
    if step >= rows_per_block:
        step -= step % rows_per_block
    start, size = item.start, item.size
    return [(item.fqn, entry, rows[a:a + step],
             plan_target(entry, item.layout, (start[0] + a, *start[1:]), (min(step, len(rows) - a), *size[1:])))
            for a in range(0, len(rows), step)]


def fill_device_targets(targets: list, make_executor: Callable[[], ReadExecutor]) -> int:
    """Read ``targets`` ((fqn, entry, GPU tensor, plan) each, stored dtype = target dtype) into
    their tensors; return the bytes read. Returns once every copy has reached its device."""
    if not targets:
        return 0
    # each target's bytes start on a block boundary, where direct I/O can read into them
    sizes = [-(-local.numel() * local.element_size() // DIRECT_ALIGN) * DIRECT_ALIGN for _, _, local, _ in targets]
    streams = {}
    for _, _, local, _ in targets:  # the side streams start after whatever is queued on the targets
        if local.device not in streams:
            streams[local.device] = torch.cuda.Stream(local.device)
            streams[local.device].wait_stream(torch.cuda.current_stream(local.device))
    waves: list[_Wave] = []
    first = make_executor()
    pool = ThreadPoolExecutor(first.threads, thread_name_prefix="statesnap-read")
    waves_of_targets = _waves(sizes)
    ring = None
    failed = True
    try:
        ring = PinnedRing(_ring_segments(sizes, waves_of_targets), targets[0][2].device)
        for index, wave in enumerate(waves_of_targets):
            waves.append(_Wave([targets[i] for i in wave], [sizes[i] for i in wave], ring,
                               first if index == 0 else make_executor(), pool, streams))
            if len(waves) > 1:  # two waves read at once; the one before them goes to the devices
                waves[-2].copy_to_devices()
        waves[-1].copy_to_devices()
        ring.drain()
        failed = False
    finally:  # after a failure too: no read may still fill, and no copy still read, the ring
        pool.shutdown(wait=True, cancel_futures=True)
        for executor in (first, *(wave.executor for wave in waves)):
            executor.close()
        try:
            for stream in streams.values():
                try:
                    stream.synchronize()
                except Exception:  # noqa: BLE001 (the failure being raised is the one to report)
                    if not failed:
                        raise
        finally:
            if ring is not None:
                ring.close()
    return sum(wave.executor.bytes_read for wave in waves)


def _ring_segments(sizes: list[int], waves: list[list[int]]) -> list[int]:
    """The ends of the ring's segments, on page boundaries (a page locked twice would be refused).

    One segment per wave where the waves take no more room than the ring would; else room for
    the largest part and two waves, as three segments of a wave each (the usual case: parts are
    a wave at most, and the first copies wait for one wave's locking only) or, with a part
    larger than a wave, as that part's segment and one of two waves, so that two such parts
    (of up to two waves) are still read and copied at once."""
    page = max(mmap.PAGESIZE, DIRECT_ALIGN)
    largest = max(*sizes, WAVE_BYTES)
    room = [-(-sum(sizes[i] for i in wave) // page) * page for wave in waves]
    if sum(room) <= largest + 2 * WAVE_BYTES:
        ends = list(itertools.accumulate(size for size in room if size))  # (waves of empty targets: none)
        return ends or [page]
    largest = -(-largest // page) * page
    if largest == WAVE_BYTES:
        return [largest, largest + WAVE_BYTES, largest + 2 * WAVE_BYTES]
    return [largest, largest + 2 * WAVE_BYTES]


def _waves(sizes: list[int]) -> list[list[int]]:
    """Consecutive targets in groups of about ``WAVE_BYTES`` (a larger target is a wave alone)."""
    waves, current, total = [], [], 0
    for index, size in enumerate(sizes):
        if current and total + size > WAVE_BYTES:
            waves.append(current)
            current, total = [], 0
        current.append(index)
        total += size
    return waves + [current] if current else waves
