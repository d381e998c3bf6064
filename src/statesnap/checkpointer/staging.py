"""The host staging arena and the copies into it.

One buffer, allocated once and reused, so no checkpoint pays for allocation (or, on a GPU, for
pinning). It is handed out as regions in ring order. Regions are freed in any order, but space is
reclaimed only from the oldest one (a slow write of an old region holds back the ring, never
corrupts it). A snapshot that fits is *resident*: it gets one region and stays in the arena after
it is written, as the memory level, until the ring needs its space again. A state larger than the
arena streams through it in batches that are freed as soon as they are written: copies then wait
for writes (back-pressure) instead of failing or growing past the budget.
"""
from __future__ import annotations

import ctypes
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..errors import CheckpointError
from ..plan.save_plan import ALIGN
from ..storage.aligned import HUGE_PAGE, huge_aligned_pages, pinned_pages
from ..storage.base import DIRECT_ALIGN

REGION_ALIGN = DIRECT_ALIGN  # regions start on page boundaries, as direct I/O needs
MAX_SEGMENT_BYTES = 64 << 20  # a large tensor is copied and written in chunks of this size


def segment_of(arena_bytes: int) -> int:
    """The staging segment of an arena: a power of two, a quarter of it at most."""
    return min(MAX_SEGMENT_BYTES, 1 << max(12, (arena_bytes // 4).bit_length() - 1))

BUSY, HELD, FREE = "busy", "held", "free"


def align_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(eq=False)
class Region:
    start: int
    nbytes: int
    state: str = BUSY
    on_evict: Callable[[], None] | None = None


_MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python's mmap module does not name it everywhere


def _populate(buffer: torch.Tensor) -> None:
    """Fault the arena's pages in, in the background, without writing to them: a copy into
    fresh anonymous memory takes a page fault every 4 KiB and ran at a third of the speed of a
    copy into touched pages (1.8 against 6.3 GB/s here), which the next optimizer step waited
    for. The first snapshot's copy races this (both only fault pages in); later ones find the
    pages there.

    One huge page per call: the call holds the process's memory-map lock while it faults its
    range in, and any ``mmap``/``munmap`` of the training thread (a large tensor allocated or
    freed) waits behind it. On this project's VM, where memory the guest touches first is slow
    to come (0.14-0.56 s for 370 MB), one call for the whole arena held the forward pass after
    the first save up for 0.8 s; in 2 MiB calls it lost 25-70 ms (docs/benchmarks.md). The
    thread holds ``buffer`` so the memory stays mapped until it is done. ctypes releases the GIL
    for each call; an older kernel refuses the first one, harmlessly."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    address, nbytes = buffer.data_ptr(), buffer.numel()
    for offset in range(0, nbytes, HUGE_PAGE):
        size = min(HUGE_PAGE, nbytes - offset)
        if madvise(ctypes.c_void_p(address + offset), ctypes.c_size_t(size), _MADV_POPULATE_WRITE) != 0:
            return


class Arena:
    """A fixed host buffer handing out regions in ring order; :meth:`allocate` blocks when full."""

    def __init__(self, capacity: int, pin: bool):
        self.capacity = max(capacity // REGION_ALIGN, 1) * REGION_ALIGN  # never above the budget
        # page-aligned private memory, as direct I/O needs (storage/aligned.py)
        if pin:
            self.buffer = pinned_pages(self.capacity)
        else:
            self.buffer = torch.frombuffer(huge_aligned_pages(self.capacity), dtype=torch.uint8)
            threading.Thread(target=_populate, args=(self.buffer,),
                             name="statesnap-arena-populate", daemon=True).start()
        self._live: deque[Region] = deque()
        self._head = 0
        self._cond = threading.Condition()

    def view(self, start: int, nbytes: int) -> torch.Tensor:
        return self.buffer[start:start + nbytes]

    def allocate(self, nbytes: int) -> Region:
        """A region of ``nbytes``; waits for older regions to be freed, evicting held ones first."""
        nbytes = align_up(max(nbytes, 1), REGION_ALIGN)
        if nbytes > self.capacity:
            raise CheckpointError(f"a staging region of {nbytes} bytes does not fit the {self.capacity}-byte arena")
        with self._cond:
            while True:
                start = self._fit(nbytes)
                if start is not None:
                    region = Region(start, nbytes)
                    self._live.append(region)
                    self._head = start + nbytes
                    return region
                if self._live[0].state == HELD:
                    self._evict(self._live[0])
                    continue
                region = self._take_held(nbytes)
                if region is not None:
                    return region
                self._cond.wait()

    def _take_held(self, nbytes: int) -> Region | None:
        """The space of a held region further along the ring, while the oldest one is still busy
        (being written). Without this, a snapshot kept only for the memory level stood between
        the next snapshot and free space, and that snapshot's copy (so the next optimizer step)
        waited for the whole write: on a GPU, 0.68 s of a 28 ms step. The memory level gives up
        its older snapshot for the newer one instead."""
        for index, region in enumerate(self._live):
            if region.state == HELD and region.nbytes >= nbytes:
                self._drop(region)
                taken = Region(region.start, nbytes)
                self._live[index] = taken  # same place in the ring: the ring's order still holds
                return taken
        return None

    def _fit(self, nbytes: int) -> int | None:
        if not self._live:
            return 0
        tail = self._live[0].start
        if self._head > tail:  # used space is [tail, head): try after it, then wrap to the front
            if self._head + nbytes <= self.capacity:
                return self._head
            return 0 if nbytes <= tail else None
        return self._head if self._head + nbytes <= tail else None

    def _evict(self, region: Region) -> None:
        self._drop(region)
        self._reclaim()

    @staticmethod
    def _drop(region: Region) -> None:
        """Tell a held region's reader (the memory level) it is gone, and free it."""
        on_evict, region.on_evict = region.on_evict, None  # (its snapshot holds the region: no cycle left)
        if on_evict is not None:
            on_evict()
        region.state = FREE

    def _reclaim(self) -> None:
        while self._live and self._live[0].state == FREE:
            self._live.popleft()
        if not self._live:
            self._head = 0
        self._cond.notify_all()

    def release(self, region: Region) -> None:
        with self._cond:
            region.state = FREE
            self._reclaim()

    def hold(self, region: Region, on_evict: Callable[[], None]) -> None:
        """Keep a written region readable until its space is needed; ``on_evict`` runs then."""
        with self._cond:
            region.on_evict = on_evict
            region.state = HELD
            self._cond.notify_all()

    def borrow(self, region: Region) -> bool:
        """Protect a held region from eviction while it is read; False if it is gone."""
        with self._cond:
            if region.state != HELD:
                return False
            region.state = BUSY
            return True

    def evict_all(self) -> bool:
        """Drop every held region; True if the arena is now empty (nothing busy)."""
        with self._cond:
            for region in list(self._live):
                if region.state == HELD:
                    self._evict(region)
            return not self._live


@dataclass
class Segment:
    """A byte range of one tensor item: where it lands in the arena and in the data file."""

    item: int
    offset: int  # byte offset inside the item
    nbytes: int
    arena: int  # byte offset from the batch's base in the arena
    file: int | None  # byte offset in this rank's data file; None when another rank writes it


@dataclass
class Batch:
    """Segments copied by one task and freed together; small tensors share a batch."""

    segments: list[Segment]
    owners: set = field(default_factory=set)
    region: Region | None = None  # its own region when streaming; None inside a resident snapshot

    @property
    def arena_span(self) -> tuple[int, int]:
        first, last = self.segments[0], self.segments[-1]
        return first.arena, last.arena + last.nbytes


def build_batches(order: Sequence[int], sizes: Sequence[int], splittable: Sequence[bool],
                  owners: Sequence, file_offsets: dict[int, int], resident: bool,
                  segment_bytes: int) -> tuple[list[Batch], list[int]]:
    """Cut the items (copy ``order``) into batches of about ``segment_bytes``.

    Resident: every item, laid out one after another in one region; returns each item's offset
    in it (the memory level reads them back). Streaming: only the items this rank writes, each
    batch laid out from its own zero.
    """
    batches: list[Batch] = []
    item_offsets = [0] * len(sizes)
    current: list[Segment] = []
    pos = batch_bytes = 0
    for item in order:
        if not resident and item not in file_offsets:
            continue
        size = sizes[item]
        step = segment_bytes if splittable[item] else max(size, 1)
        for offset in range(0, max(size, 1), step):
            nbytes = min(step, size - offset)
            if current and batch_bytes + nbytes > segment_bytes:
                batches.append(Batch(current))
                current, batch_bytes = [], 0
                pos = pos if resident else 0
            file = file_offsets[item] + offset if item in file_offsets else None
            pos = align_up(pos, ALIGN)
            if file is not None:  # same distance from a block boundary as in the file: direct I/O
                pos += (file - pos) % DIRECT_ALIGN
            if offset == 0:
                item_offsets[item] = pos
            current.append(Segment(item, offset, nbytes, pos, file))
            pos += nbytes
            batch_bytes += nbytes
    if current:
        batches.append(Batch(current))
    for batch in batches:
        batch.owners = {owners[s.item] for s in batch.segments if owners[s.item] is not None}
    return batches, item_offsets


def copy_into(dst: torch.Tensor, src: torch.Tensor, offset: int, resolved: bool = True) -> None:
    """Copy ``dst.numel()`` bytes of the CPU tensor ``src`` from byte ``offset`` into the arena view ``dst``.

    Sources whose memory holds their values in order go through ``memmove`` via ctypes, which
    releases the GIL, so the training thread runs on while the copy proceeds. (GPU sources take
    the stream-ordered path, gpu.py.) ``resolved``: ``src`` has no conjugate or negative bit left
    to resolve, as its layout found once (``state_cache.Layout.resolved``): looked at for every
    segment of every save, the two bits cost the save of a thousand small tensors 15-20 % of
    ``save()``'s time (the copy threads hold the GIL beside the training thread).
    """
    nbytes = dst.numel()
    if resolved and src.is_contiguous():
        if nbytes:
            ctypes.memmove(dst.data_ptr(), src.data_ptr() + offset, nbytes)
    elif src.is_contiguous():  # a conjugated or negated view: copied by elements, which resolves its bit
        dst.view(src.dtype).copy_(in_order_part(src, offset, nbytes))
    else:  # strided sources are copied whole (their items are never split)
        dst.view(src.dtype).view(src.shape).copy_(src)


def in_order_part(src: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The elements of the contiguous ``src`` in its bytes ``[offset, offset + nbytes)`` (whole
    elements: segments split items at block boundaries)."""
    size = src.element_size()
    return src.reshape(-1)[offset // size:(offset + nbytes) // size]


def item_bytes_view(buffer: torch.Tensor, start: int, like: torch.Tensor) -> torch.Tensor:
    """The staged bytes at ``start`` seen as a tensor of ``like``'s dtype and shape."""
    nbytes = like.numel() * like.element_size()
    return buffer[start:start + nbytes].view(like.dtype).view(like.shape)
