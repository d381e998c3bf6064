"""The local backend's bulk writes: whole blocks bypass the page cache, the bytes stay exact."""
import mmap
import os

import numpy as np
import pytest

from statesnap.checkpointer.staging import Arena
from statesnap.storage import aligned
from statesnap.storage.base import DIRECT_ALIGN
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
def test_bulk_writes_are_exact_at_any_distance_from_a_block(tmp_path, monkeypatch, skew):
    import statesnap.storage.local as local

    monkeypatch.setattr(local, "BOUNCE", aligned.BouncePool())
    monkeypatch.setattr(aligned, "BOUNCE_BYTES", 512 << 10)
    """Ranges at the same distance from a block in memory and in the file go direct in the middle
    and buffered at the ends; other ranges go through an aligned bounce buffer (several rounds
    of it here). The file holds exactly the bytes."""
    memory = aligned_bytes(8 * MiB, seed=skew)
    jobs = [  # (file offset, memory start, length)
        (skew, skew, 3 * MiB + 100),  # congruent, partial blocks at both ends
        (4 * MiB + skew, 4 * MiB + skew + 64, 2 * MiB),  # not congruent: bounced, 4+ rounds
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


def test_durable_saves_from_unaligned_tensors_round_trip(tmp_path):
    """A durable blocking save sends every tensor through pwrite_bulk, most of them from memory at
    another distance from a block than their file offset; each element must come back."""
    import torch

    import statesnap as ss

    base = torch.randn(3 * MiB + 7)
    state = {"a": base[7:], "b": torch.randint(-2**31, 2**31 - 1, (MiB + 3,), dtype=torch.int32),
             "c": torch.randn(5, 1, 300_001).to(torch.bfloat16), "small": torch.arange(10)}
    ss.save(state, str(tmp_path / "ckpt"), durable=True)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    ss.load(loaded, str(tmp_path / "ckpt"))
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


def test_long_lived_direct_write_buffers_start_on_a_huge_page():
    """The bounce buffers kept between saves and the staging arena start on a huge-page boundary:
    a 16 MiB direct write from a buffer that starts inside one straddles nine huge pages and goes
    out in smaller requests (storage/aligned.py)."""
    pool = aligned.BouncePool(keep=2)
    kept = [pool.take(), pool.take()]
    assert [aligned.address(b) % aligned.HUGE_PAGE for b in kept] == [0, 0]
    assert {len(b) for b in kept} == {aligned.BOUNCE_BYTES + DIRECT_ALIGN}
    kept[0][-1] = 7  # the whole length is there to write
    for bounce in kept:
        pool.give(bounce)
    arena = Arena(5 * aligned.HUGE_PAGE + DIRECT_ALIGN, pin=False)
    assert arena.buffer.data_ptr() % aligned.HUGE_PAGE == 0 and arena.capacity == 5 * aligned.HUGE_PAGE + DIRECT_ALIGN
    arena.buffer[-1] = 1


def test_a_name_too_long_to_stage_is_refused_naming_its_limit(tmp_path):
    """A name the file system would take (245 bytes) but whose temporary staging name would not:
    the error names the user's name and the longest one that works, and nothing is left behind;
    a name of that length saves, and is overwritten (an overwrite works under longer names)."""
    import torch

    import statesnap as ss
    from statesnap.errors import CheckpointError

    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    words = rf"cannot save to .*a{{8}}: its name is {limit - 10} bytes.*at most (\d+) bytes"
    with pytest.raises(CheckpointError, match=words) as err:
        ss.save({"t": torch.ones(2)}, tmp_path / ("a" * (limit - 10)))
    longest = int(err.value.args[0].rsplit("at most ", 1)[1].split()[0])
    assert os.listdir(tmp_path) == []
    ss.save({"t": torch.zeros(2)}, tmp_path / ("b" * longest))
    ss.save({"t": torch.ones(2)}, tmp_path / ("b" * longest), overwrite=True)
    target = {"t": torch.zeros(2)}
    ss.load(target, tmp_path / ("b" * longest))
    assert torch.equal(target["t"], torch.ones(2))


def test_a_save_whose_staging_directory_cannot_take_its_name_leaves_nothing_open(tmp_path, monkeypatch):
    """The rename of a fresh staging directory to its own name fails (EIO): each such save left
    its ``.new`` directory, which no clean-up removes, and its descriptor open."""
    import errno

    import torch

    import statesnap as ss

    real = os.rename

    def rename(src, dst, *args, **kwargs):
        if str(src).endswith(".new"):
            raise OSError(errno.EIO, "Input/output error", src)
        return real(src, dst, *args, **kwargs)
    monkeypatch.setattr(os, "rename", rename)
    for _ in range(5):
        with pytest.raises(ss.CheckpointError, match="Input/output error"):
            ss.save({"t": torch.zeros(2)}, tmp_path / "ck")
    assert os.listdir(tmp_path) == []

    def opened_here(fd):
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path))
        except OSError:  # (closed meanwhile)
            return False
    assert not [fd for fd in os.listdir("/proc/self/fd") if opened_here(fd)]


def test_a_failure_after_the_commit_s_rename_says_the_new_checkpoint_is_in_place(tmp_path, monkeypatch):
    """EIO on the fsync of the parent directory, after the rename: the save raised "committing
    failed", which reads as "the old checkpoint is still there", while the new one was in place
    and the old one gone."""
    import errno

    import torch

    import statesnap as ss
    from statesnap.storage import local

    ss.save({"t": torch.zeros(2)}, tmp_path / "ck")
    real = local.fsync_dir

    def fsync_dir(path):
        if os.path.abspath(path) == str(tmp_path):
            raise OSError(errno.EIO, "Input/output error")
        return real(path)
    monkeypatch.setattr(local, "fsync_dir", fsync_dir)
    with pytest.raises(ss.CheckpointError, match="ck holds the new checkpoint, but what follows its rename failed "
                                                 r"\(Input/output error\): it may not survive a crash"):
        ss.save({"t": torch.ones(2)}, tmp_path / "ck", overwrite=True)
    target = {"t": torch.zeros(2)}
    ss.load(target, tmp_path / "ck")
    assert torch.equal(target["t"], torch.ones(2))


def test_a_checkpoint_set_aside_is_named_by_its_entry():
    """A root's leftovers are searched for set-aside checkpoints in one listing: a search per
    leftover (a listing each) made a Checkpointer on a root of thousands of them quadratic."""
    backend = LocalBackend()
    assert backend.set_aside_for(".step-3.tmp-ab12.old") == "step-3"
    assert backend.set_aside_for(".ck.tmp-x.tmp-abc.old") == "ck.tmp-x"  # (ck.tmp-x's, not ck's)
    for name in (".step-3.tmp-ab12", "step-3", ".step-3.tmp-zz.old", ".step-3.old"):
        assert backend.set_aside_for(name) is None
