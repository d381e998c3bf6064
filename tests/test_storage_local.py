"""The local backend's bulk writes: whole blocks bypass the page cache, the bytes stay exact."""
import mmap
import os

import numpy as np
import pytest

from statesnap.storage.local import LocalBackend

MiB = 1 << 20


def aligned_bytes(nbytes: int, seed: int) -> memoryview:
    mapping = mmap.mmap(-1, nbytes)
    np.frombuffer(mapping, dtype=np.uint8)[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return memoryview(mapping)


def direct_io_supported(directory) -> bool:
    try:
        os.close(os.open(os.path.join(directory, "probe"), os.O_CREAT | os.O_WRONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):  # tmpfs refuses it; other systems lack the flag
        return False


@pytest.mark.parametrize("skew", [0, 64, 4032])
def test_bulk_writes_are_exact_at_any_distance_from_a_block(tmp_path, skew):
    """Ranges at the same distance from a block in memory and in the file go direct in the middle
    and buffered at the ends; any other range goes buffered. The file holds exactly the bytes."""
    memory = aligned_bytes(8 * MiB, seed=skew)
    jobs = [  # (file offset, memory start, length)
        (skew, skew, 3 * MiB + 100),  # congruent, partial blocks at both ends
        (4 * MiB + skew, 4 * MiB + skew + 64, 2 * MiB),  # not congruent: all buffered
        (7 * MiB, 7 * MiB, 1000),  # too small to bother
    ]
    path = str(tmp_path / "data")
    writer = LocalBackend().open_write(path, durable=True)
    for offset, start, nbytes in jobs:
        writer.pwrite_bulk(offset, memory[start:start + nbytes])
    direct = writer._direct_fd is not None and writer._direct_fd >= 0
    writer.close(durable=True)
    on_disk = open(path, "rb").read()
    assert len(on_disk) == 7 * MiB + 1000
    for offset, start, nbytes in jobs:
        assert on_disk[offset:offset + nbytes] == memory[start:start + nbytes]
    assert direct == direct_io_supported(tmp_path)  # the congruent range used it where it exists


def test_bulk_writes_fall_back_where_direct_io_is_refused(tmp_path, monkeypatch):
    import statesnap.storage.local as local

    monkeypatch.setattr(local, "_O_DIRECT", 0)
    memory = aligned_bytes(4 * MiB, seed=1)
    path = str(tmp_path / "data")
    writer = LocalBackend().open_write(path)
    writer.pwrite_bulk(0, memory)
    assert writer._direct_fd == -1
    writer.close(durable=False)
    assert open(path, "rb").read() == memory.tobytes()


def test_blocking_durable_save_round_trips_through_direct_writes(tmp_path):
    """A durable ss.save sends unaligned tensor memory through the bounce buffers: every byte of
    every tensor (odd sizes, odd offsets in memory) comes back exact and verified."""
    import torch

    import statesnap as ss

    backing = torch.randn(5 * MiB)
    state = {"odd": backing[3:3 + 3 * MiB + 5], "aligned": torch.randn(2 * MiB),
             "small": torch.arange(1000, dtype=torch.int16), "bf16": torch.randn(MiB + 7).to(torch.bfloat16)}
    ss.save(state, str(tmp_path / "ck"), durable=True)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    ss.load(loaded, str(tmp_path / "ck"), verify=True)
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
    stored = sum(v.numel() * v.element_size() for v in state.values())
    assert ss.open(str(tmp_path / "ck")).verify() >= stored  # every stored byte checked, no damage


def test_bounced_writes_longer_than_one_bounce_buffer_are_exact(tmp_path):
    memory = aligned_bytes(18 * MiB, seed=7)
    view = memory[100:100 + 17 * MiB + 3]  # 100 bytes past a block in memory, 4000 in the file
    path = str(tmp_path / "data")
    writer = LocalBackend().open_write(path, durable=True)
    writer.pwrite_bulk(4000, view)
    writer.close(durable=True)
    with open(path, "rb") as f:
        f.seek(4000)
        assert f.read() == view.tobytes()
