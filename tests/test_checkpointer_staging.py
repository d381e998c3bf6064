"""The staging arena's ring allocation and the cutting of items into batches."""
import ctypes
import threading

import pytest
import torch

import statesnap as ss
from statesnap.storage.base import DIRECT_ALIGN
from statesnap.checkpointer.staging import REGION_ALIGN, Arena, build_batches, copy_into
from statesnap.errors import CheckpointError
from test_checkpointer import make_training

PAGE = REGION_ALIGN


def test_regions_are_reclaimed_oldest_first_even_when_freed_out_of_order():
    arena = Arena(4 * PAGE, pin=False)
    a, b, c = (arena.allocate(PAGE) for _ in range(3))
    assert [a.start, b.start, c.start] == [0, PAGE, 2 * PAGE]
    arena.release(b)  # freed, but a still holds the ring's tail
    d = arena.allocate(PAGE)
    assert d.start == 3 * PAGE
    got = []
    waiter = threading.Thread(target=lambda: got.append(arena.allocate(2 * PAGE)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # full: back-pressure, not failure
    arena.release(a)  # now a and b are reclaimed together
    waiter.join()
    assert got[0].start == 0


def test_held_regions_are_evicted_when_space_is_needed():
    arena = Arena(2 * PAGE, pin=False)
    evicted = []
    first = arena.allocate(PAGE)
    arena.hold(first, lambda: evicted.append("first"))
    second = arena.allocate(PAGE)
    assert not arena.borrow(second)  # only held regions can be borrowed
    arena.release(second)
    assert arena.borrow(first)  # protected while read...
    arena.hold(first, lambda: evicted.append("first"))
    third = arena.allocate(2 * PAGE)  # ...and evicted once held again and in the way
    assert third.start == 0 and evicted == ["first"]


def test_a_held_region_gives_way_while_the_oldest_is_still_being_written():
    arena = Arena(2 * PAGE, pin=False)
    evicted = []
    writing = arena.allocate(PAGE)  # busy: a persisted snapshot being written
    kept = arena.allocate(PAGE)
    arena.hold(kept, lambda: evicted.append("kept"))  # the memory level's snapshot
    newer = arena.allocate(PAGE)  # does not wait for the write
    assert newer.start == kept.start and evicted == ["kept"]
    assert not arena.borrow(kept)  # the memory level cannot read the evicted one any more
    got = []
    waiter = threading.Thread(target=lambda: got.append(arena.allocate(PAGE)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # nothing held: back-pressure again
    arena.release(writing)
    waiter.join()
    assert got[0].start == 0
    arena.release(newer)
    arena.release(got[0])
    assert arena.evict_all()


def test_a_region_larger_than_the_arena_is_refused():
    with pytest.raises(CheckpointError, match="does not fit"):
        Arena(PAGE, pin=False).allocate(PAGE + 1)


def test_batches_cover_every_byte_once():
    sizes = [100, 5000, 0, 64, 3000]
    splittable = [True, True, True, False, True]
    owners = [None, 1, None, 1, 2]
    writes = {1: 0, 3: 5056, 4: 5120}
    for resident in (True, False):
        batches, offsets = build_batches([0, 2, 1, 3, 4], sizes, splittable, owners, writes, resident, 1024)
        covered = {}
        for batch in batches:
            assert batch.owners == {owners[s.item] for s in batch.segments} - {None}
            for seg in batch.segments:
                covered.setdefault(seg.item, []).append((seg.offset, seg.nbytes))
                assert seg.nbytes <= 1024 or not splittable[seg.item]
                if seg.file is not None:
                    assert seg.file == writes[seg.item] + seg.offset
                    assert (seg.arena - seg.file) % DIRECT_ALIGN == 0  # direct I/O from the arena
                if resident:
                    assert seg.arena == offsets[seg.item] + seg.offset and seg.arena % 64 == 0
        items = range(len(sizes)) if resident else writes
        for item in items:
            ranges = sorted(covered[item])
            assert sum(n for _, n in ranges) == sizes[item]
            assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))


def test_copy_into_handles_contiguous_slices_and_strided_tensors():
    buffer = torch.zeros(64, dtype=torch.uint8)
    src = torch.arange(8, dtype=torch.int32)
    copy_into(buffer[:8], src, 4)
    assert torch.equal(buffer[:8], src.view(torch.uint8)[4:12])
    strided = torch.arange(12, dtype=torch.int16).reshape(3, 4).t()
    copy_into(buffer[:24], strided, 0)
    assert torch.equal(buffer[:24].view(torch.int16).view(4, 3), strided)


def test_the_arena_is_allocated_once_within_the_budget(tmp_path):
    model, optim = make_training(width=128, depth=4)
    budget = 200_000  # not a multiple of the region alignment
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=budget / 1e9, keep_last=1)
    ckpt.save(1, {"model": model, "optim": optim})
    arena = ckpt._arena
    ckpt.save(2, {"model": model, "optim": optim})
    assert ckpt._arena is arena and arena.capacity <= budget
    ckpt.close()


def test_snapshots_between_persists_do_not_wait_for_a_slow_write(tmp_path, monkeypatch):
    """While step 4 is being written (held back here), steps 5-7 are staged in memory one after
    another: each takes the space of the memory level's previous snapshot rather than waiting
    for the write. Step 4 is still committed exactly, and the memory level restores step 7."""
    from statesnap.checkpointer import pipeline
    from test_checkpointer import assert_checkpoint_equals, reference, train_step

    write_may_finish = threading.Event()
    real_write = pipeline.Flusher._write

    def held_write(self, *args, **kwargs):
        assert write_may_finish.wait(60)
        return real_write(self, *args, **kwargs)
    monkeypatch.setattr(pipeline.Flusher, "_write", held_write)
    model, optim = make_training(width=64)
    state = {"model": model, "optim": optim}
    train_step(model, optim, 0)
    with ss.Checkpointer(tmp_path, persist_every=4, keep_last=2) as ckpt:
        persisted = ckpt.save(4, state)
        expected = reference(state)
        for step in (5, 6, 7):
            train_step(model, optim, step)
            assert ckpt.save(step, state).staged.result(timeout=30) == step
        assert not persisted.durable.done()
        latest = reference(state)
        write_may_finish.set()
        assert persisted.wait(60) is not None
        ckpt.wait_staged()  # staged resolves before the copy thread hands the snapshot to the memory level
        assert ckpt.stats()["memory_step"] == 7
        for t in model.parameters():
            t.data.zero_()
        assert ckpt.load_latest(state) == 7 and ckpt.loaded_from == "memory"
    assert_checkpoint_equals(persisted.durable.result(), expected)
    for fqn, value in reference(state).items():
        assert torch.equal(value, latest[fqn]), fqn


def test_a_forked_child_gets_the_arena_wiped_not_shared():
    """A DataLoader forks its workers while the arena exists: a child sharing its pages
    copy-on-write would make every later write of the parent there copy the page first, and
    keep the old copies. The child gets zeroed memory of its own at the same place (usable, and
    released without touching the parent's)."""
    import os

    arena = Arena(8 * PAGE, pin=False)
    arena.buffer.fill_(7)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            seen = int(arena.buffer[-1])  # zero: wiped, not the parent's 7
            arena.buffer.fill_(9)  # its own: the parent's stay 7
            os.write(write, f"{seen} {int(arena.buffer[0])}".encode())
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 100).decode()
    os.close(read)
    assert os.waitpid(pid, 0)[1] == 0
    assert answer == "0 9"
    assert int(arena.buffer[0]) == 7 and int(arena.buffer[-1]) == 7


def _resident_pages(address: int, nbytes: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    vector = (ctypes.c_ubyte * (nbytes // 4096))()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vector) == 0
    return sum(byte & 1 for byte in vector)


def test_the_arena_pages_are_faulted_in_by_the_background_thread_in_huge_page_calls(monkeypatch):
    """Every page of the arena is resident once its populating thread is done, and the thread
    asks for at most one huge page per call: one call for the whole arena held the memory-map
    lock long enough to stall the training thread's allocations (staging._populate)."""
    from types import SimpleNamespace

    from statesnap.checkpointer import staging
    from statesnap.storage.aligned import HUGE_PAGE, private_pages

    libc = ctypes.CDLL(None, use_errno=True)
    probe = memoryview(private_pages(4096))
    if libc.madvise(ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(probe))), ctypes.c_size_t(4096),
                    staging._MADV_POPULATE_WRITE) != 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    calls = []

    def madvise(address, size, advice):
        calls.append(size.value)
        return libc.madvise(address, size, advice)

    monkeypatch.setattr(staging, "ctypes", SimpleNamespace(CDLL=lambda *a, **k: SimpleNamespace(madvise=madvise),
                                                         c_void_p=ctypes.c_void_p, c_size_t=ctypes.c_size_t))
    arena = Arena(5 * HUGE_PAGE + 3 * REGION_ALIGN, pin=False)
    for thread in threading.enumerate():
        if thread.name == "statesnap-arena-populate":
            thread.join(timeout=60)
    assert calls == [HUGE_PAGE] * 5 + [3 * REGION_ALIGN]
    assert _resident_pages(arena.buffer.data_ptr(), arena.capacity) == arena.capacity // 4096
