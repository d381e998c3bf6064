"""The GPU path: snapshots from GPU tensors, restores and loads into them (docs/checkpointer.md).

The tests marked ``cuda`` need a CUDA device and are skipped without one (CI has none; they run
on a GPU machine). The ring and wave logic the GPU load is built on is tested here on the CPU.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import time

import pytest
import torch

import statesnap as ss
from statesnap.engine import device_load
from statesnap.engine.device_load import PinnedRing, _waves

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def releaser(log, name):
    return lambda: log.append(name)


def test_ring_releases_only_the_slots_that_hold_the_space_it_hands_out():
    log = []
    ring = PinnedRing([100])
    assert ring.take(40) == 0
    ring.hold(0, 40, releaser(log, "a"))
    assert ring.take(40) == 40
    ring.hold(40, 40, releaser(log, "b"))
    assert log == []  # both fit: nothing waited for
    assert ring.take(30) == 0  # wraps: releases "a", which holds [0, 40), not "b"
    assert log == ["a"]
    ring.hold(0, 30, releaser(log, "c"))
    assert ring.take(50) == 30  # [30, 80) overlaps "b" only
    assert log == ["a", "b"]
    ring.hold(30, 50, releaser(log, "d"))
    ring.drain()
    assert log == ["a", "b", "c", "d"]


def test_ring_hands_out_the_whole_capacity_to_one_large_request():
    log = []
    ring = PinnedRing([64])
    ring.hold(ring.take(16), 16, releaser(log, "a"))
    ring.hold(ring.take(16), 16, releaser(log, "b"))
    assert ring.take(64) == 0 and log == ["a", "b"]


def test_no_slot_crosses_a_segment_end_of_the_ring():
    """Separately locked ranges are separate allocations to the driver: a copy out of two fails."""
    ring = PinnedRing([100, 150, 200])
    assert ring.take(60) == 0
    assert ring.take(30) == 60  # fits before 100
    assert ring.take(30) == 100  # would cross 100: the next segment
    assert ring.take(40) == 150  # would cross 150
    assert ring.take(60) == 0  # larger than the segments after it: wraps
    assert ring.take(40) == 60
    assert ring.take(50) == 100  # exactly the second segment
    assert ring.take(100) == 0  # only the first holds it
    with pytest.raises(ValueError):
        ring.take(101)


def test_the_ring_has_a_segment_per_wave_or_room_for_two_parts_in_flight(monkeypatch):
    page = max(mmap.PAGESIZE, device_load.DIRECT_ALIGN)
    monkeypatch.setattr(device_load, "WAVE_BYTES", 4 * page)
    segments = device_load._ring_segments

    def of(sizes):
        return [end // page for end in segments([n * page for n in sizes], _waves([n * page for n in sizes]))]

    assert of([1, 1, 1, 10, 0, 1]) == [3, 13, 14]  # a segment per wave: no more room than the ring's
    assert of([4] * 6) == [4, 8, 12]  # three waves of a wave each
    assert of([2, 12, 2, 2, 2, 2]) == [12, 20]  # a part larger than a wave, and room for two waves
    assert of([0, 0]) == [1]
    assert segments([5000], [[0]]) == [-(-5000 // page) * page]  # ends on page boundaries


def test_two_parts_larger_than_a_wave_are_in_flight_at_once(monkeypatch):
    """With parts of two waves (checksum blocks of two waves), the next part's reads start before
    the one before it is released, as they did in a ring of one piece."""
    page = max(mmap.PAGESIZE, device_load.DIRECT_ALIGN)
    monkeypatch.setattr(device_load, "WAVE_BYTES", 4 * page)
    sizes = [8 * page] * 5
    ring = PinnedRing(device_load._ring_segments(sizes, _waves(sizes)))
    log = []
    for index, size in enumerate(sizes):
        ring.hold(ring.take(size), size, releaser(log, index))
        if index == 1:
            assert log == []  # the second part found room beside the first
    assert log == [0, 1, 2]


def test_waves_group_consecutive_targets_and_put_a_large_one_alone(monkeypatch):
    monkeypatch.setattr(device_load, "WAVE_BYTES", 100)
    assert _waves([40, 40, 40, 250, 10, 100, 1]) == [[0, 1], [2], [3], [4], [5], [6]]
    assert _waves([]) == []
    assert _waves([100, 100]) == [[0], [1]]


class NoStream:
    """Stands in for a CUDA stream on a machine without one: the wave pipeline's reads, checks,
    slots and error paths run for real on CPU tensors, the device copies as plain copies."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass


class FakeLocks:
    """Stands in for cudaHostRegister/Unregister: records the segments locked and unlocked, and
    the device context current at each call. The call numbered ``fail_at`` (from 0) fails."""

    def __init__(self, monkeypatch, fail_at=None):
        self.locked, self.unlocked, self.devices = [], [], []
        self.fail_at, self.current, self.calls = fail_at, None, 0
        monkeypatch.setattr(device_load, "lock_pages", self.lock)
        monkeypatch.setattr(device_load, "unlock_pages", self.unlocked.append)
        monkeypatch.setattr(torch.cuda, "device", self.device)

    @contextlib.contextmanager
    def device(self, device):
        self.current = device
        yield

    def lock(self, start, nbytes):
        call, self.calls = self.calls, self.calls + 1
        if call == self.fail_at:
            raise ss.CheckpointError("could not pin (test)")
        self.locked.append((start, nbytes))
        self.devices.append(self.current)


@pytest.fixture
def host_streams(monkeypatch) -> FakeLocks:
    """The wave pipeline on the CPU (NoStream, FakeLocks): what it locks and unlocks."""
    monkeypatch.setattr(torch.cuda, "Stream", NoStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: NoStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(device_load, "WAVE_BYTES", 1 << 16)
    return FakeLocks(monkeypatch)


def test_the_ring_is_locked_where_copies_need_it_once_and_unlocked_at_close(monkeypatch):
    """A segment is locked when a copy first needs it (its pages faulted in by the reads), once,
    on the targets' device; a failure to lock is raised there; close() unlocks what was locked."""
    locks = FakeLocks(monkeypatch)
    ring = PinnedRing([4096, 2 * 4096, 3 * 4096, 4 * 4096 + 100], torch.device("cpu"))
    base = ring.buffer.data_ptr()
    ring.lock(4096, 4096)  # the second segment alone
    ring.lock(0, 2 * 4096 + 1)  # the first and third, the second already locked
    ring.lock(2 * 4096, 0)
    assert locks.locked == [(base + 4096, 4096), (base, 4096), (base + 2 * 4096, 4096)]
    assert set(locks.devices) == {torch.device("cpu")}  # the targets' device
    ring.close()
    assert sorted(locks.unlocked) == [base + i * 4096 for i in range(3)]

    ring = PinnedRing([1], None)  # no device: nothing locked
    ring.lock(0, 1)
    ring.close()
    assert len(locks.locked) == 3 and len(locks.unlocked) == 3

    locks = FakeLocks(monkeypatch, fail_at=1)
    ring = PinnedRing([4096, 2 * 4096, 3 * 4096], torch.device("cpu"))
    base = ring.buffer.data_ptr()
    ring.lock(0, 4096)
    with pytest.raises(ss.CheckpointError, match="could not pin"):
        ring.lock(4096, 2 * 4096)
    ring.close()
    assert locks.unlocked == [base]


def test_a_load_that_cannot_lock_its_ring_names_why_and_unlocks_what_it_locked(tmp_path, host_streams, monkeypatch):
    from statesnap.engine.read import ReadExecutor
    from statesnap.plan import plan_target
    from statesnap.state.items import TensorItem
    from statesnap.storage import LocalBackend

    path = str(tmp_path / "c")
    ss.save({"big": tall()}, path, block_bytes=4096)
    manifest = ss.open(path).manifest
    item = TensorItem("big", torch.zeros(300, 1000), (300, 1000))
    entry = manifest.tensor_part("big", item.layout, item.start, item.size)
    targets = device_load.wave_parts(item, entry, plan_target(entry, item.layout, item.start, item.size),
                                     manifest.block_bytes)
    host_streams.fail_at = 1  # the ring's second segment: the first wave is copied, the second is not
    with pytest.raises(ss.CheckpointError, match="could not pin"):
        device_load.fill_device_targets(targets, lambda: ReadExecutor(LocalBackend(), path, manifest))
    assert host_streams.locked and sorted(host_streams.unlocked) == sorted(s for s, _ in host_streams.locked)


def _save_rows(rank, world, path):
    """Two ranks, each a block of rows of ``big`` that ends off any wave or block boundary (4 KiB)."""
    cut = 137
    rows = slice(0, cut) if rank == 0 else slice(cut, None)
    whole = tall()
    ss.save({"big": ss.Sharded(whole[rows].contiguous(), tuple(whole.shape), (rows.start, 0))}, path, block_bytes=4096)


def tall() -> torch.Tensor:
    return torch.randn(300, 1000, generator=torch.Generator().manual_seed(3))  # 1.2 MB: 19 waves of 64 KiB


@pytest.mark.parametrize("source, block_bytes", [("whole", 16 << 10), ("whole", 4096), ("whole", 1000),
                                                 ("two row blocks", 4096)],
                         ids=["16 KiB blocks", "4 KiB blocks", "1000-byte blocks", "two row blocks"])
def test_a_tensor_larger_than_a_wave_loads_in_parts_through_a_ring_of_three_waves(tmp_path, host_streams, source,
                                                                                   block_bytes):
    """The ring stays about three waves whatever the largest tensor, and every part (rows that
    cross the stored pieces' edges and checksum blocks, a target that is a box of the tensor, a
    1-D tensor, a flat shard) lands bit for bit."""
    from dist_utils import run_ranks
    from statesnap.engine.read import ReadExecutor
    from statesnap.format.manifest import BOX, FLAT
    from statesnap.plan import plan_target
    from statesnap.state.items import TensorItem
    from statesnap.storage import LocalBackend

    path = str(tmp_path / "c")
    expected = {"big": tall()}
    if source == "two row blocks":
        run_ranks(2, _save_rows, path)
    else:
        expected["long"] = torch.arange(300_000, dtype=torch.float32)  # 1-D: parts of elements
        ss.save(expected, path, block_bytes=block_bytes)
    manifest = ss.open(path).manifest
    big = expected["big"]
    wanted = {name: (t, TensorItem(name, torch.full_like(t, -1.0), tuple(t.shape))) for name, t in expected.items()}
    wanted["big rows 50-250"] = (big[50:250], TensorItem("big", torch.full((200, 1000), -1.0), (300, 1000),
                                                         BOX, (50, 0), (200, 1000)))
    wanted["big, a flat shard"] = (big.view(-1)[1234:251234], TensorItem("big", torch.full((250_000,), -1.0),
                                                                        (300, 1000), FLAT, (1234,), (250_000,)))
    targets = []
    for values, item in wanted.values():
        entry = manifest.tensor_part(item.fqn, item.layout, item.start, item.size)
        plan = plan_target(entry, item.layout, item.start, item.size)
        targets += device_load.wave_parts(item, entry, plan, manifest.block_bytes)
    assert len(targets) > 3 * len(wanted)
    nbytes = device_load.fill_device_targets(targets, lambda: ReadExecutor(LocalBackend(), path, manifest))
    assert nbytes >= sum(item.local.numel() * 4 for _, item in wanted.values())
    for name, (values, item) in wanted.items():
        assert torch.equal(item.local.view(torch.int32), values.reshape(item.local.shape).view(torch.int32)), name
    ring = sum(size for _, size in host_streams.locked)  # the one ring's segments
    assert 0 < ring <= 3 * (1 << 16) + 4096
    assert sorted(host_streams.unlocked) == sorted(start for start, _ in host_streams.locked)


def test_a_failed_wave_stops_the_reads_and_closes_every_file(tmp_path, host_streams):
    from statesnap.engine.read import ReadExecutor
    from statesnap.format.manifest import BOX
    from statesnap.plan import plan_target
    from statesnap.storage import LocalBackend
    from statesnap.storage import local

    state = {f"w{i}": torch.full((1 << 14,), float(i)) for i in range(8)}  # 64 KiB each: a wave each
    ss.save(state, tmp_path / "c")
    opened, closed, failures = [], [], []

    class Reader(local._LocalReader):
        def __init__(self, path):
            super().__init__(path)
            opened.append(self)

        def readinto(self, offset, views):
            time.sleep(0.05)  # the next wave's reads are under way when wave 0 fails
            try:
                return super().readinto(offset, views)
            except OSError as exc:  # a read on a closed file
                failures.append(exc)
                raise

        def close(self):
            closed.append(self)
            super().close()

    class Backend(LocalBackend):
        def open_read(self, path):
            return Reader(path)

    backend, path = Backend(), str(tmp_path / "c")
    manifest = ss.open(path).manifest
    targets = []
    for fqn, t in state.items():
        entry = manifest.tensor_part(fqn, BOX, (0,), tuple(t.shape))
        targets.append((fqn, entry, torch.full_like(t, -1.0), plan_target(entry, BOX, (0,), tuple(t.shape))))
    with open(tmp_path / "c" / manifest.files[0], "r+b") as f:
        f.seek(100)  # inside w0
        f.write(b"\xff" * 8)
    with pytest.raises(ss.CheckpointError, match="'w0'"):
        device_load.fill_device_targets(targets, lambda: ReadExecutor(backend, path, manifest, threads=4))
    assert opened and set(map(id, opened)) <= set(map(id, closed)) and not failures
    assert all(bool((t == -1).all()) for _, _, t, _ in targets[:1])
    targets = [(fqn, entry, torch.full_like(t, -1.0), plan) for fqn, entry, t, plan in targets[1:]]
    assert device_load.fill_device_targets(targets, lambda: ReadExecutor(backend, path, manifest)) == 7 << 16
    assert all(torch.equal(t, state[fqn]) for fqn, _, t, _ in targets)


# ----------------------------------------------------------------------------- GPU

def gpu_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def step(model, opt, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(32, 64, device="cuda", generator=gen)
    loss = model(x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def snapshot(model, opt) -> dict:
    state = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for index, s in opt.state_dict()["state"].items():
        state.update({f"optim.{index}.{k}": v.detach().cpu().clone() for k, v in s.items() if torch.is_tensor(v)})
    return state


def assert_bit_exact(expected: dict, model, opt):
    actual = snapshot(model, opt)
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key].view(-1).view(torch.uint8), value.view(-1).view(torch.uint8)), key


@cuda
def test_save_and_load_gpu_state_bit_exact_through_many_waves_and_a_wrapping_ring(tmp_path, monkeypatch):
    # many waves, and the ring wraps through its three separately locked segments
    monkeypatch.setattr(device_load, "WAVE_BYTES", 64 << 10)
    model, opt = gpu_state()
    for i in range(3):
        step(model, opt, i)
    big = torch.randn(1 << 18, device="cuda")  # 1 MiB: 16 parts of a wave, in 16 KiB checksum blocks
    big2 = torch.randn(1000, 300, device="cuda")  # rows of 1200 bytes: parts end inside blocks
    strided = torch.randn(400, 96, device="cuda").t()  # a strided GPU target larger than a wave: staged whole
    half = torch.randn(1000, device="cuda").to(torch.bfloat16)
    ss.save({"model": model, "optim": opt, "extra": {"big": big, "big2": big2, "strided": strided, "half": half}},
            tmp_path / "c", block_bytes=16 << 10)
    expected = snapshot(model, opt)
    extras = {"big": big.cpu(), "big2": big2.cpu(), "strided": strided.cpu(), "half": half.cpu()}

    fresh, fresh_opt = gpu_state()
    step(fresh, fresh_opt, 99)  # different values everywhere
    targets = {"big": torch.zeros_like(big), "big2": torch.zeros_like(big2), "strided": torch.zeros(400, 96, device="cuda").t(),
               "half": torch.zeros_like(half)}
    ss.load({"model": fresh, "optim": fresh_opt, "extra": targets}, tmp_path / "c")
    assert_bit_exact(expected, fresh, fresh_opt)
    for key, value in extras.items():
        assert targets[key].device.type == "cuda"
        assert torch.equal(targets[key].cpu(), value), key


@cuda
def test_a_damaged_file_names_the_tensor_and_nothing_unverified_reaches_the_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(device_load, "WAVE_BYTES", 64 << 10)
    state = {f"w{i}": torch.full((1 << 14,), float(i), device="cuda") for i in range(8)}  # 64 KiB each
    ss.save(state, tmp_path / "c")
    data = [p for p in (tmp_path / "c").iterdir() if p.is_file() and p.stat().st_size >= 8 * (1 << 16)]
    with open(data[0], "r+b") as f:  # one file holds the eight tensors, in order
        f.seek(5 * (1 << 16) + 100)
        f.write(b"\xff" * 8)
    targets = {k: torch.full_like(v, -1.0) for k, v in state.items()}
    with pytest.raises(ss.CheckpointError, match="'w5'"):
        ss.load(targets, tmp_path / "c")
    assert bool((targets["w5"] == -1).all())  # the damaged wave never reached the GPU


@cuda
def test_checkpointer_snapshots_are_the_values_at_save_even_with_kernels_queued(tmp_path):
    """The copy stream waits for the work queued before save() and the next optimizer step waits for
    the copies: each persisted checkpoint equals the state at its save() call, bit for bit."""
    model, opt = gpu_state()
    expected, paths = {}, {}
    with ss.Checkpointer(tmp_path / "ck", keep_last=10, host_memory_gb=1) as ckpt:
        assert ckpt.config.copy_threads == 1
        for i in range(1, 6):
            step(model, opt, i)
            with torch.no_grad():  # a long queue of kernels still writing a parameter at save()
                weight = model[0].weight
                for _ in range(200):
                    weight.mul_(1.0001)
            ckpt.save(i, {"model": model, "optim": opt})
            torch.cuda.synchronize()
            expected[i] = snapshot(model, opt)
            paths[i] = ckpt.persistent.path(i)
        assert ckpt._arena.buffer.is_pinned()
    for i, values in expected.items():
        fresh, fresh_opt = gpu_state()
        step(fresh, fresh_opt, 0)
        ss.load({"model": fresh, "optim": fresh_opt}, paths[i])
        assert_bit_exact(values, fresh, fresh_opt)


@cuda
def test_restore_from_memory_into_gpu_tensors_is_bit_exact(tmp_path):
    model, opt = gpu_state()
    step(model, opt, 1)
    with ss.Checkpointer(tmp_path / "ck", persist_every=1000) as ckpt:
        ckpt.save(1, {"model": model, "optim": opt}).staged.result()
        expected = snapshot(model, opt)
        step(model, opt, 2)
        assert ckpt.load_latest({"model": model, "optim": opt}) == 1
        assert ckpt.loaded_from == "memory"
        assert_bit_exact(expected, model, opt)


@cuda
def test_batchnorm_statistics_beside_frozen_weights_past_the_eager_limit_keep_every_checkpoint(tmp_path):
    """Past ``eager_copy_mb`` of tensors no optimizer writes (frozen weights), the BatchNorm
    statistics the next forward changes are waited for by ``save`` on a GPU as on the CPU:
    skipped there, every checkpoint followed by a forward failed its version check."""
    frozen = [torch.nn.Linear(2048, 2048).requires_grad_(False) for _ in range(2)]
    model = torch.nn.Sequential(*frozen, torch.nn.BatchNorm1d(2048), torch.nn.Linear(2048, 8)).cuda()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with ss.Checkpointer(tmp_path / "ck", host_memory_gb=1, eager_copy_mb=1, keep_last=5) as ckpt:
        handles = []
        for i in range(1, 5):
            model(torch.randn(256, 2048, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
            handles.append((ckpt.save(i, {"model": model, "optim": opt}), model[2].running_mean.cpu()))
        for handle, running_mean in handles:
            handle.wait()
            assert torch.equal(ss.open(handle.durable.result()).read("model.2.running_mean"), running_mean)


@cuda
def test_a_conjugated_or_negated_view_on_the_lazy_path_keeps_its_values(tmp_path):
    base = torch.randn(1000, dtype=torch.cfloat, device="cuda")
    real = torch.randn(1000, device="cuda")
    with ss.Checkpointer(tmp_path / "ck", eager_copy_mb=0) as ckpt:
        path = ckpt.save(1, {"c": base.conj(), "n": real._neg_view()}).wait()
    assert torch.equal(ss.open(path).read("c"), base.conj().resolve_conj().cpu())
    assert torch.equal(ss.open(path).read("n"), (-real).cpu())


def test_the_gpu_suite_says_it_skipped_without_a_device(monkeypatch, tmp_path):
    from statesnap.bench import gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = gpu.run(out=str(tmp_path))
    assert result == {"suite": "gpu", "skipped": "no CUDA device"}
    assert "skipped" in gpu.report(result)
    assert not os.listdir(tmp_path)
