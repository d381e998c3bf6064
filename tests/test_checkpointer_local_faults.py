"""The node-local level when one node's copy goes wrong: damaged, another run's, cut short by a
crash, unlistable, or gone back past. Two gloo ranks stand for two nodes (``GROUP_RANK``), each
with a node-local root of its own."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import time
import warnings

import pytest
import torch

import statesnap as ss
from dist_utils import local_level, run_ranks


def _checkpointer(rank, dirs, **settings):
    os.environ["GROUP_RANK"] = str(rank)
    settings = {"local_every": 1, "host_memory_gb": 0.02, "commit_timeout_s": 30, **settings}
    return ss.Checkpointer(dirs["root"], local_root=dirs["local"][rank], **settings)


def _state(rank, value):
    return {"w": ss.Sharded(torch.full((4, 4), float(value)), (8, 4), (4 * rank, 0))}


def _dirs(base):
    return {"root": str(base / "root"), "local": [str(base / "node0"), str(base / "node1")]}


def _save(rank, world, dirs, steps, offset, settings):
    with _checkpointer(rank, dirs, **settings) as ckpt:
        for step in steps:
            ckpt.save(step, _state(rank, offset + 10 * step + rank)).wait()


def _restart(rank, world, dirs, settings, started=lambda: None):
    state = _state(rank, -1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (what is passed over is warned of: not asserted here)
        with _checkpointer(rank, dirs, **settings) as ckpt:
            started()
            step = ckpt.load_latest(state)
            return step, ckpt.loaded_from, state["w"].local.unique().tolist()


REPLICAS = dict(peer_replicas=1, persist_every=2)


@pytest.mark.parametrize("damage", ["garbled manifest", "another run's copy"])
def test_a_bad_copy_of_the_newest_step_on_one_node_is_replaced_from_the_other(tmp_path, damage):
    """Node 1's copy of step 3 has a garbled manifest, or is another run's commit of step 3
    (another token): node 0 holds every file of step 3 (its own and node 1's replica), so the
    restart restores step 3 and writes node 1's copy anew. Node 1's copy used to make the
    fetch's commit fail with "step-3 already exists" at every restart, so no restart ever
    succeeded until someone deleted the directory by hand."""
    dirs = _dirs(tmp_path)
    run_ranks(2, _save, dirs, (1, 2, 3), 0, REPLICAS)
    node1 = os.path.join(local_level(dirs["local"][1], dirs["root"]), "step-3")
    if damage == "garbled manifest":
        with open(os.path.join(node1, "manifest.json"), "r+b") as f:
            f.seek(10)
            f.write(b"\x00garbage\x00")
    else:
        other = _dirs(tmp_path / "other")
        other["root"] = dirs["root"] + "-elsewhere"
        run_ranks(2, _save, other, (3,), 100, dict(persist_every=2))
        shutil.rmtree(node1)
        shutil.copytree(os.path.join(local_level(other["local"][1], other["root"]), "step-3"), node1)
    assert run_ranks(2, _restart, dirs, REPLICAS) == [(3, "peer", [30.0]), (3, "peer", [31.0])]
    # node 1's copy is whole again: the next restart fetches nothing
    assert run_ranks(2, _restart, dirs, REPLICAS) == [(3, "local", [30.0]), (3, "local", [31.0])]


def _die_before_node_1_commits(rank, world, dirs, settings):
    from statesnap.storage import local as storage_local

    ckpt = _checkpointer(rank, dirs, **settings)
    for step in (1, 2):
        ckpt.save(step, _state(rank, 10 * step + rank)).wait()
    if rank == 1:  # node 1 dies right before it commits step 3 on its node
        real = storage_local.LocalBackend.commit

        def commit(self, staging, final, *args, **kwargs):
            if final.endswith("step-3"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, staging, final, *args, **kwargs)
        storage_local.LocalBackend.commit = commit
    ckpt.save(3, _state(rank, 30 + rank))
    committed = os.path.join(local_level(dirs["local"][0], dirs["root"]), "step-3")
    deadline = time.monotonic() + 60
    while not os.path.exists(committed) and time.monotonic() < deadline:  # node 0 commits step 3 meanwhile
        time.sleep(0.05)
    time.sleep(1)  # (and its retention, which ran right after its own commit, has run)
    os.kill(os.getpid(), signal.SIGKILL)  # and the job is gone


def test_a_node_keeps_its_last_step_until_every_node_has_committed_the_next(tmp_path):
    """``local_keep_last=1``, no replicas: node 0 deleted step 2 as soon as it had committed step
    3 itself, and node 1 died before its own commit of step 3: no step was whole on the nodes,
    and the restart found nothing to restore ("the nodes hold 1 of its 2 data files"). A node
    now applies retention once every node has committed."""
    dirs, settings = _dirs(tmp_path), dict(local_keep_last=1, persist_every=100)
    with pytest.raises(AssertionError, match="exited with code -9"):
        run_ranks(2, _die_before_node_1_commits, dirs, settings)
    assert "step-2" in os.listdir(local_level(dirs["local"][0], dirs["root"]))
    assert run_ranks(2, _restart, dirs, settings) == [(2, "local", [20.0]), (2, "local", [21.0])]


def _restart_with_node_1_unlistable(rank, world, dirs, settings):
    from statesnap.storage import local as storage_local

    level, real = os.path.abspath(local_level(dirs["local"][1], dirs["root"])), storage_local.LocalBackend.listdir

    def listdir(self, path):
        if os.path.abspath(path) == level:
            raise OSError(errno.EIO, "Input/output error", path)
        return real(self, path)

    def disk_fails():  # once the Checkpointer has started
        if rank == 1:
            storage_local.LocalBackend.listdir = listdir
    return _restart(rank, world, dirs, settings, disk_fails)


def test_a_node_local_level_that_cannot_be_listed_leaves_the_restore_to_the_other_levels(tmp_path):
    """Node 1's disk fails to list its level: the restart restores step 2 from root. It used
    to raise a bare OSError on rank 1 while rank 0 waited in the exchange for commit_timeout_s."""
    dirs, settings = _dirs(tmp_path), dict(persist_every=2)
    run_ranks(2, _save, dirs, (1, 2), 0, settings)
    assert run_ranks(2, _restart_with_node_1_unlistable, dirs, settings) == [
        (2, "persistent", [20.0]), (2, "persistent", [21.0])]


def test_a_run_that_went_back_keeps_the_step_it_saves_on_the_node_local_and_further_levels(tmp_path):
    """Restored at step 5, the run goes back and saves step 3 again (its step counter restarted,
    or a rollback): the node-local and further levels deleted the new step 3 by the retention
    of its own commit, silently, as older than steps 4 and 5. It is kept now, with the warning
    the persistent level gives."""
    root, local, further = tmp_path / "root", tmp_path / "local", tmp_path / "further"
    settings = dict(local_root=local, local_keep_last=2, further_root=further, further_every=1,
                    further_keep_last=2, keep_last=2, host_memory_gb=0.02)
    state = {"w": torch.zeros(4)}
    with ss.Checkpointer(root, **settings) as ckpt:
        for step in range(1, 6):
            state["w"].fill_(step)
            ckpt.save(step, state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ss.Checkpointer(root, **settings) as ckpt:
            assert ckpt.load_latest(state) == 5
            state["w"].fill_(33)
            ckpt.save(3, state).wait()
    for level in (local_level(local, root), further, root):
        assert "step-3" in os.listdir(level), level
        assert torch.equal(ss.open(os.path.join(level, "step-3")).read("w"), torch.full((4,), 33.0))
    warned = [str(w.message) for w in caught if "step 3 was committed at" in str(w.message)]
    assert any(local_level(local, root) in w for w in warned), warned


def test_every_spelling_of_a_root_finds_the_same_node_local_level(tmp_path):
    """A restart that spelt its root otherwise (a trailing slash on an object store's URL, a
    doubled slash, a link to the local root) looked in another node-local directory: it restored
    from root the steps its node-local level held newer, and a later restart spelt the first way
    restored the abandoned steps."""
    from statesnap.checkpointer.local import job_directory
    from statesnap.storage.local import LocalBackend

    def level(root):
        return job_directory(str(tmp_path / "local"), root, LocalBackend())
    assert len({level(r) for r in ("s3://b/run", "s3://b/run/", "S3://b//run", "s3://b/./run")}) == 1
    os.makedirs(tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert level(str(tmp_path / "link")) == level(str(tmp_path / "real") + "/")
    assert level("s3://b/run") != level("s3://b/other") != level(str(tmp_path / "real"))
    root = "memory://spelt-" + os.path.basename(tmp_path) + "/run"
    with ss.Checkpointer(root, local_root=tmp_path / "local", persist_every=4, host_memory_gb=0.01) as ckpt:
        for step in (1, 2, 3, 4, 5):
            ckpt.save(step, {"w": torch.full((4,), float(step))}).wait()
    target = {"w": torch.zeros(4)}
    with ss.Checkpointer(root + "/", local_root=tmp_path / "local", persist_every=4, host_memory_gb=0.01) as ckpt:
        assert ckpt.load_latest(target) == 5 and ckpt.loaded_from == "local"
