"""I/O errors at every read and write of a save and a load (``faulty://``): each one surfaces as a
CheckpointError naming the file, and none leaves a partial checkpoint visible."""
import errno

import fsspec
import pytest
import torch

import statesnap as ss
from statesnap.bench.faults import Faults, FaultyFileSystem


def small_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 30, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
            "steps": torch.arange(5), "extra": {"epoch": seed, "name": "run", "seen": {seed, "a"}}}  # a set: pickled


def blank_state() -> dict:
    return {"w": torch.zeros(40, 30), "b": torch.zeros(7).bfloat16(), "steps": torch.zeros(5, dtype=torch.long),
            "extra": {"epoch": -1, "name": "", "seen": set()}}


def assert_same(state: dict, expected: dict) -> None:
    for key in ("w", "b", "steps"):
        assert torch.equal(state[key].view(torch.uint8), expected[key].view(torch.uint8)), key
    assert state["extra"] == expected["extra"]


def assert_loads(path: str, target: str, seed: int) -> None:
    """``path`` loads, without faults, the values of ``small_state(seed)`` bit for bit."""
    state = blank_state()
    ss.load(state, path, **options(Faults(), target))
    assert_same(state, small_state(seed))


def stored_names(target: str, path: str) -> set[str]:
    """File names under ``path`` as the wrapped file system holds them."""
    fs, inner = fsspec.filesystem(target), FaultyFileSystem._strip_protocol(path)
    return {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(inner, detail=False)} if fs.exists(inner) else set()


@pytest.fixture(params=["memory", "file"])
def place(request, tmp_path):
    """(URL prefix, wrapped file system): memory, or a local directory."""
    if request.param == "file":
        return f"faulty://{tmp_path}", "file"
    root, memory = f"statesnap-faults/{tmp_path.name}", fsspec.filesystem("memory")
    if memory.exists(root):
        memory.rm(root, recursive=True)
    return f"faulty://{root}", "memory"


def options(faults: Faults, target: str) -> dict:
    """The keywords of save, load and open: these faults over ``target``; the set is pickled."""
    return {"storage_options": {"faults": faults, "target_protocol": target}, "allow_pickle": True}


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_a_save_failing_at_any_write_raises_and_leaves_nothing_visible(place, code):
    prefix, target = place
    faults = Faults(errno=code)
    ss.save(small_state(0), f"{prefix}/count", **options(faults, target))
    writes = faults.writes
    assert writes >= 4  # the data file's open and writes, the manifest
    for n in range(1, writes + 1):
        path = f"{prefix}/fresh-{n}"
        faults.reset(fail_write=n)
        with pytest.raises(ss.CheckpointError) as info:
            ss.save(small_state(n), path, **options(faults, target))
        assert faults.injected, n
        assert path.split("://", 1)[1] in str(info.value)
        assert stored_names(target, path) == set(), n  # nothing partial, not even data files
        faults.reset()
        with pytest.raises(ss.CheckpointError):
            ss.open(path, **options(faults, target))


def test_an_overwrite_failing_at_any_write_keeps_the_committed_checkpoint(place):
    prefix, target = place
    path = f"{prefix}/step-1"
    faults = Faults()
    ss.save(small_state(1), path, **options(faults, target))
    committed = stored_names(target, path)
    faults.reset()
    ss.save(small_state(2), f"{prefix}/count", **options(faults, target))
    for n in range(1, faults.writes + 1):
        faults.reset(fail_write=n)
        with pytest.raises(ss.CheckpointError):
            ss.save(small_state(100 + n), path, overwrite=True, **options(faults, target))
        assert stored_names(target, path) == committed, n
        assert_loads(path, target, 1)


def test_a_load_failing_at_any_read_raises_naming_the_file(place):
    prefix, target = place
    path = f"{prefix}/step-3"
    faults = Faults()
    ss.save(small_state(3), path, **options(faults, target), block_bytes=1024)
    faults.reset()
    ss.load(blank_state(), path, **options(faults, target), threads=1)
    reads = faults.reads
    assert reads >= 3  # the manifest and the data file's pieces
    for n in range(1, reads + 1):
        faults.reset(fail_read=n)
        with pytest.raises(ss.CheckpointError) as info:
            ss.load(blank_state(), path, **options(faults, target), threads=1)
        failed_file = faults.injected[0].rsplit("/", 1)[-1]
        assert failed_file in str(info.value) and "Input/output error" in str(info.value), n
    assert_loads(path, target, 3)


def test_reader_failing_at_any_read_raises_checkpoint_error(place):
    prefix, target = place
    path = f"{prefix}/step-4"
    faults = Faults()
    ss.save(small_state(4), path, **options(faults, target))
    faults.reset()
    ss.open(path, **options(faults, target)).verify()
    for n in range(1, faults.reads + 1):
        faults.reset(fail_read=n)
        with pytest.raises(ss.CheckpointError):
            ss.open(path, **options(faults, target)).verify()


def test_a_full_disk_fails_every_save_until_space_returns(place):
    prefix, target = place
    faults = Faults(fail_write=2, errno=errno.ENOSPC, sticky=True)
    for attempt in range(3):
        with pytest.raises(ss.CheckpointError, match="No space left.*free space there"):
            ss.save(small_state(attempt), f"{prefix}/full-{attempt}", **options(faults, target))
    faults.reset()
    ss.save(small_state(9), f"{prefix}/full-0", **options(faults, target))
    assert_loads(f"{prefix}/full-0", target, 9)


@pytest.mark.parametrize("call", ["pwritev", "fsync"])
def test_a_full_local_disk_names_the_file_and_what_to_do(tmp_path, monkeypatch, call):
    """A full local file system: ``ss.save`` and a Checkpointer's background save each raise a
    CheckpointError naming the data file it was writing and what to do (the system call's own
    error names neither); the checkpoint committed before stays loadable, and once there is
    space the next step commits."""
    import os

    ss.save(small_state(1), tmp_path / "before", allow_pickle=True)
    real = getattr(os, call)

    def full(fd, *args):
        if call == "fsync" or len(args) == 2:  # (fsync: every one; pwritev: its views and offset)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, *args)

    ckpt = ss.Checkpointer(tmp_path / "root", allow_pickle=True)
    monkeypatch.setattr(os, call, full)
    said = r"No space left on device: '.*data-\w+-r00000\.bin' \(the storage is full .*free space there"
    with pytest.raises(ss.CheckpointError, match=said):
        ss.save(small_state(2), tmp_path / "c", allow_pickle=True)
    with pytest.raises(ss.CheckpointError, match="step 1 .*failed in the background.*" + said):
        ckpt.save(1, small_state(3)).wait()
    monkeypatch.setattr(os, call, real)  # space again: the next step commits
    ckpt.save(2, small_state(4)).wait()
    ckpt.close()
    assert sorted(p.name for p in (tmp_path / "root").iterdir() if p.name.startswith("step-")) == ["step-2"]
    state = blank_state()
    ss.load(state, tmp_path / "before", allow_pickle=True)
    assert_same(state, small_state(1))


def test_a_disk_filling_up_at_the_manifest_says_what_to_do(tmp_path, monkeypatch):
    """The data files fit and the manifest does not: the commit's error names the manifest and
    the remedy, the save's files are gone, and the checkpoint at the path before is intact."""
    import os

    from statesnap.storage.local import LocalBackend

    ss.save(small_state(1), tmp_path / "c", allow_pickle=True)
    real = LocalBackend.write_bytes

    def full(self, path, data, durable):
        if os.path.basename(path).startswith("manifest"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(self, path, data, durable)

    monkeypatch.setattr(LocalBackend, "write_bytes", full)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(ss.CheckpointError, match=r"committing .*c failed: OSError: .*No space left on device: "
                                                 r"'.*manifest.*' \(the storage is full .*free space there"):
        ss.save(small_state(2), tmp_path / "c", allow_pickle=True, overwrite=True)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    state = blank_state()
    ss.load(state, tmp_path / "c", allow_pickle=True)
    assert_same(state, small_state(1))


@pytest.mark.parametrize("where", ["copy_file", "write_manifest"])
def test_a_further_level_filling_up_says_what_to_do(tmp_path, monkeypatch, where):
    """The copy to the further level meets a full disk, at a data file or at the manifest: the
    warning names the error's type and the remedy, as a level's own save says them."""
    import os
    import warnings

    from statesnap.checkpointer import further

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "a file of the further level")

    monkeypatch.setattr(further, where, full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = ss.Checkpointer(tmp_path / "local", further_root=str(tmp_path / "further"), further_every=2,
                               host_memory_gb=0.01, on_error="warn")
        for step in (1, 2):
            ckpt.save(step, {"w": torch.full((100,), float(step))}).wait()
        ckpt.close()
    said = [str(w.message) for w in caught if "not copied" in str(w.message)]
    assert len(said) == 1 and "OSError: [Errno 28] No space left on device" in said[0], said
    assert "(the storage is full or over its quota: free space there" in said[0], said
