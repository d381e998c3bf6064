"""Blocking ss.save over what is already at its path: a checkpoint is replaced only when asked, only
by a whole new one, and an interrupted or failed save leaves the old one loadable."""
import os
import sys

import pytest
import torch

import statesnap as ss
from statesnap.storage import backend_for
from statesnap.storage.local import LocalBackend


def test_unwritable_destination_is_a_checkpoint_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ss.CheckpointError, match="cannot save to"):
        ss.save({"t": torch.ones(2)}, tmp_path / "file" / "ckpt")


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_save_never_replaces_what_is_not_a_checkpoint(tmp_path, where):
    """overwrite=True replaces a checkpoint, not a user's directory or a Checkpointer's root."""
    root = str(tmp_path / "run") if where == "local" else f"memory://not-a-ckpt-{os.getpid()}/run"
    with ss.Checkpointer(root, host_memory_gb=0.05) as ckpt:
        ckpt.save(1, {"t": torch.ones(4)}).wait()
    backend = backend_for(root)
    backend.write_bytes(backend.join(root, "notes.txt"), b"mine", False)
    before = backend.listdir(root)
    for overwrite in (False, True):
        with pytest.raises(ss.CheckpointError, match="not part of a statesnap checkpoint"):
            ss.save({"t": torch.zeros(4)}, root, overwrite=overwrite)
    assert backend.listdir(root) == before
    assert torch.equal(ss.open(backend.join(root, "step-1")).read("t"), torch.ones(4))


@pytest.mark.parametrize("has_renameat2", [True, False])
def test_existing_checkpoint_needs_overwrite(tmp_path, monkeypatch, has_renameat2):
    if not has_renameat2:  # old kernels and some file systems: the rename-aside fallback
        monkeypatch.setattr("statesnap.storage.local._rename2", lambda src, dst, flags: False)
    path = tmp_path / "c"
    ss.save({"t": torch.zeros(4)}, path)
    with pytest.raises(ss.CheckpointExistsError, match="overwrite=True"):
        ss.save({"t": torch.ones(4)}, path)
    assert torch.equal(ss.open(path).read("t"), torch.zeros(4))
    ss.save({"t": torch.ones(4)}, path, overwrite=True)
    assert torch.equal(ss.open(path).read("t"), torch.ones(4))
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no staging or old copies left behind


def test_overwrite_keeps_old_checkpoint_loadable_until_commit(tmp_path, monkeypatch):
    path = tmp_path / "c"
    ss.save({"t": torch.zeros(4)}, path)
    seen_before_commit = []
    real_commit = LocalBackend.commit

    def commit(self, staging, final, *args, **kwargs):
        seen_before_commit.append(ss.open(final).read("t").clone())
        ss.open(final).verify()
        return real_commit(self, staging, final, *args, **kwargs)

    monkeypatch.setattr(LocalBackend, "commit", commit)
    ss.save({"t": torch.ones(4)}, path, overwrite=True)
    assert torch.equal(seen_before_commit[0], torch.zeros(4))
    assert torch.equal(ss.open(path).read("t"), torch.ones(4))


def test_failed_overwrite_leaves_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c"
    ss.save({"t": torch.zeros(4)}, path)

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sys.modules["statesnap.engine.save"], "write_file", fail)
    with pytest.raises(ss.CheckpointError, match="No space left"):
        ss.save({"t": torch.ones(4)}, path, overwrite=True)
    assert torch.equal(ss.open(path).read("t"), torch.zeros(4))
    ss.open(path).verify()
    assert [p.name for p in tmp_path.iterdir()] == ["c"]


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, SystemExit])
def test_interrupted_save_leaves_no_staging_and_the_old_checkpoint(tmp_path, monkeypatch, interruption):
    """Ctrl-C (or sys.exit from a signal handler) during the writes: the interruption goes on up,
    the hidden staging directory with its partial data goes, the earlier checkpoint stays."""
    path = tmp_path / "c"
    ss.save({"t": torch.zeros(4)}, path)

    def interrupted(*args, **kwargs):
        raise interruption()

    monkeypatch.setattr(sys.modules["statesnap.engine.save"], "write_file", interrupted)
    with pytest.raises(interruption):
        ss.save({"t": torch.ones(4)}, path, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    assert torch.equal(ss.open(path).read("t"), torch.zeros(4))


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("when", ["reporting to owners", "writing the manifest", "after the commit"])
def test_save_interrupted_around_its_commit_leaves_one_whole_checkpoint(tmp_path, monkeypatch, interruption, when):
    """Ctrl-C after the writes: before the commit the staging directory goes and the old checkpoint
    stays; after it the new checkpoint stays, whole."""
    path = tmp_path / "c"
    ss.save({"t": torch.zeros(4)}, path)
    module = sys.modules["statesnap.engine.save"]
    if when == "reporting to owners":
        monkeypatch.setattr(module, "gather_reports", lambda *a, **k: (_ for _ in ()).throw(interruption()))
    else:
        real = module.commit_manifest

        def interrupted(backend, *args, **kwargs):
            if when == "after the commit":
                real(backend, *args, **kwargs)
            else:
                monkeypatch.setattr(backend, "write_bytes", lambda *a, **k: (_ for _ in ()).throw(interruption()))
                real(backend, *args, **kwargs)
            raise interruption()
        monkeypatch.setattr(module, "commit_manifest", interrupted)
    with pytest.raises(interruption):
        ss.save({"t": torch.ones(4)}, path, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    expected = torch.ones(4) if when == "after the commit" else torch.zeros(4)
    assert torch.equal(ss.open(path).read("t"), expected)
    ss.open(path).verify()


def test_overwrite_killed_between_fallback_renames_is_recovered(tmp_path, monkeypatch):
    """Without renameat2 an overwrite renames the old checkpoint aside, then the new one in. A
    kill between the two leaves only the aside: the next load puts the old checkpoint back."""
    import statesnap.storage.local as local

    path = tmp_path / "c"
    ss.save({"t": torch.zeros(4)}, path)
    monkeypatch.setattr(local, "_rename2", lambda *args: False)
    real_rename = os.rename

    def killed_after_first_rename(src, dst):
        real_rename(src, dst)
        if str(dst).endswith(".old"):
            raise KeyboardInterrupt  # stands in for SIGKILL: nothing after this line runs

    monkeypatch.setattr(local.os, "rename", killed_after_first_rename)
    with pytest.raises(KeyboardInterrupt):
        ss.save({"t": torch.ones(4)}, path, overwrite=True)
    monkeypatch.setattr(local.os, "rename", real_rename)
    assert not path.exists()
    target = {"t": torch.ones(4)}
    ss.load(target, path)
    assert torch.equal(target["t"], torch.zeros(4)) and path.is_dir()
    ss.open(path).verify()

    # Killed again, then saved to anew: the aside is still the checkpoint there, so a save
    # without overwrite is refused and one with it replaces the aside, which does not outlive it.
    # (Two asides left by two such kills had made a load take the older one half the time.)
    for value in (1.0, 2.0):
        monkeypatch.setattr(local.os, "rename", killed_after_first_rename)
        with pytest.raises(KeyboardInterrupt):
            ss.save({"t": torch.full((4,), value + 10)}, path, overwrite=True)
        monkeypatch.setattr(local.os, "rename", real_rename)
        assert not path.exists()
        with pytest.raises(ss.CheckpointExistsError):
            ss.save({"t": torch.full((4,), value)}, path)
        ss.save({"t": torch.full((4,), value)}, path, overwrite=True)
        assert [p.name for p in tmp_path.iterdir()] == ["c"]
    monkeypatch.setattr(local.os, "rename", killed_after_first_rename)
    with pytest.raises(KeyboardInterrupt):
        ss.save({"t": torch.full((4,), 30.0)}, path, overwrite=True)
    monkeypatch.setattr(local.os, "rename", real_rename)
    ss.load(target, path)
    assert torch.equal(target["t"], torch.full((4,), 2.0))

    # Killed while deleting the old checkpoint after a completed overwrite: what is left is no
    # aside (nothing puts it back, even once the checkpoint at the name is gone).
    real_rmtree = local.shutil.rmtree

    def killed_while_deleting(where, *args, **kwargs):
        raise KeyboardInterrupt  # stands in for SIGKILL

    monkeypatch.setattr(local.shutil, "rmtree", killed_while_deleting)
    with pytest.raises(KeyboardInterrupt):
        ss.save({"t": torch.full((4,), 3.0)}, path, overwrite=True)
    monkeypatch.setattr(local.shutil, "rmtree", real_rmtree)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".old")]
    real_rmtree(path)
    ss.save({"t": torch.full((4,), 4.0)}, path)  # nothing there: no old checkpoint comes back
    ss.load(target, path)
    assert torch.equal(target["t"], torch.full((4,), 4.0))

    # the aside of a checkpoint named c.tmp-x is its own, not c's
    other = tmp_path / "c.tmp-x"
    ss.save({"t": torch.full((4,), 7.0)}, other)
    monkeypatch.setattr(local.os, "rename", killed_after_first_rename)
    with pytest.raises(KeyboardInterrupt):
        ss.save({"t": torch.full((4,), 8.0)}, other, overwrite=True)
    monkeypatch.setattr(local.os, "rename", real_rename)
    ss.save({"t": torch.full((4,), 5.0)}, path, overwrite=True)
    ss.load(target, other)
    assert torch.equal(target["t"], torch.full((4,), 7.0))


KILLED_WRITER = """
import os, signal, sys, torch
import statesnap as ss
from statesnap.storage.local import LocalBackend
kind, path = sys.argv[1], sys.argv[2]
def killed(self, staging, *args, **kwargs):  # everything written, nothing committed
    os.kill(os.getpid(), signal.SIGKILL)
LocalBackend.commit = killed
if kind == "save":
    ss.save({"t": torch.full((1 << 16,), 2.0)}, path, overwrite=True)
else:
    ss.export(sys.argv[3], path, to="safetensors")
"""


@pytest.mark.parametrize("kind", ["save", "export"])
def test_staging_a_killed_writer_left_is_removed_by_the_next_one_to_that_path(tmp_path, kind):
    """``kill -9`` between the writes and the commit leaves a hidden staging directory as large as
    the checkpoint, which nothing else would ever delete; the next save (or export) to that name
    removes it, since no live process holds its lock. The checkpoint at the name stays whole."""
    import subprocess
    source = tmp_path / "source"
    ss.save({"t": torch.full((1 << 16,), 1.0)}, source)
    path = tmp_path / "out"
    if kind == "save":
        ss.save({"t": torch.zeros(1 << 16)}, path)
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER, kind, str(path), str(source)], timeout=120)
    assert done.returncode == -9
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(left) == 1 and left[0].is_dir() and any(left[0].iterdir())
    if kind == "save":
        assert torch.equal(ss.open(path).read("t"), torch.zeros(1 << 16))
        ss.save({"t": torch.ones(1 << 16)}, path, overwrite=True)
        assert torch.equal(ss.open(path).read("t"), torch.ones(1 << 16))
    else:
        ss.export(source, path, to="safetensors")
        assert path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "source"]


def test_staging_a_live_writer_holds_is_left_alone(tmp_path):
    """A second process saving to the same name finds the first one's staging directory locked:
    it is a save in progress, and removing it would make that save fail."""
    from statesnap.storage.local import LocalBackend
    backend = LocalBackend()
    staging = backend.begin(str(tmp_path / "out"), "0123456789ab")
    (tmp_path / ".out.tmp-abcdef").mkdir()  # no lock held on it: a killed writer's
    ss.save({"t": torch.ones(4)}, tmp_path / "out2")  # another name: neither is touched
    assert (tmp_path / ".out.tmp-abcdef").is_dir()
    ss.save({"t": torch.ones(4)}, tmp_path / "out")
    assert os.path.isdir(staging) and not (tmp_path / ".out.tmp-abcdef").exists()
    backend.abort(staging, str(tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out2"]


def test_a_path_that_resolves_to_a_directory_of_user_files_is_never_replaced(tmp_path, monkeypatch):
    """``ss.save(state, "", overwrite=True)`` replaced the working directory, and so did a path
    through a directory that does not exist (``proj/missing/..``): the check for files that are
    not a checkpoint's listed no such directory and found nothing, while the commit resolved the
    path by its text to the directory itself, and deleted what was in it."""
    project = tmp_path / "proj"
    (project / "data").mkdir(parents=True)
    (project / "train.py").write_text("print('hi')")
    monkeypatch.chdir(project)
    state = {"t": torch.ones(2)}
    with pytest.raises(ss.CheckpointError, match="the checkpoint path is empty"):
        ss.save(state, "", overwrite=True)
    for path in ["data/missing/../..", str(project / "missing" / "..")]:
        with pytest.raises(ss.CheckpointError, match="holds what is not part of a statesnap checkpoint"):
            ss.save(state, path, overwrite=True)
    with pytest.raises(ss.CheckpointError, match="the checkpoint path is empty"):
        ss.convert(tmp_path / "none.pt", "", source="torch", overwrite=True)
    assert sorted(p.name for p in project.iterdir()) == ["data", "train.py"]
    ss.save(state, "ck/missing/..", overwrite=True)  # a path to a new directory: saved there
    assert torch.equal(ss.open(project / "ck").read("t"), torch.ones(2))


def test_bytes_paths_name_their_decoded_path_and_nul_characters_are_refused(tmp_path, monkeypatch):
    """A bytes path was written to a directory named after its repr (``b'...'``); a NUL character
    raised a bare ValueError from ``ss.open`` and ``ss.Checkpointer``."""
    monkeypatch.chdir(tmp_path)
    info = ss.save({"t": torch.ones(2)}, b"ck")
    assert info.path == "ck" and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert torch.equal(ss.open(b"ck").read("t"), torch.ones(2))
    with ss.Checkpointer(os.fsencode(tmp_path / "root"), host_memory_gb=0.01) as ckpt:
        ckpt.save(1, {"t": torch.ones(2)}).wait()
    assert (tmp_path / "root" / "step-1").is_dir()
    for call in (lambda p: ss.save({"t": torch.ones(2)}, p), ss.open, lambda p: ss.Checkpointer(p)):
        with pytest.raises(ss.CheckpointError, match="holds a NUL character"):
            call("a\0b")


@pytest.mark.parametrize("has_renameat2", [True, False])
def test_an_overwrite_of_a_link_replaces_the_link_and_leaves_what_it_pointed_to(tmp_path, monkeypatch, has_renameat2):
    """``latest -> step-100`` saved over with overwrite=True: ``latest`` becomes the new
    checkpoint, ``step-100`` stays whole, and the link does not stay behind under a hidden name
    (the deletion of what was swapped out took it for a directory and left it)."""
    import statesnap.storage.local as local
    if not has_renameat2:
        monkeypatch.setattr(local, "_rename2", lambda *args: False)
    ss.save({"t": torch.zeros(4)}, tmp_path / "step-100")
    os.symlink("step-100", tmp_path / "latest")
    ss.save({"t": torch.ones(4)}, tmp_path / "latest", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-100"]
    assert not (tmp_path / "latest").is_symlink()
    assert torch.equal(ss.open(tmp_path / "latest").read("t"), torch.ones(4))
    assert torch.equal(ss.open(tmp_path / "step-100").read("t"), torch.zeros(4))
