"""The node-local level and peer replicas: 4 gloo ranks as 2 simulated nodes (different
``GROUP_RANK`` and local roots) train and checkpoint, are SIGKILLed, node 1's level is wiped, and
restarts on 4 and on 3 ranks restore the newest step from the partner's replica, bit for bit; a
damaged replica sends the restart to the step before, and to ``root`` past damaged ones."""
import os
import shutil
import signal
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import statesnap as ss
from dist_utils import local_level, run_ranks
from statesnap.storage import SHM_ROOT, normalize
from test_checkpointer import assert_state_equals, make_training, reference, train_step

STEPS, PERSIST_EVERY, GLOBAL_ROWS = 13, 10, 24


def _node(rank: int, world: int) -> int:
    return 0 if rank < (world + 1) // 2 else 1


def _state(rank: int, world: int, seed: int = 0):
    model, optim = make_training(seed)  # same seed on every rank: replicated, as DDP's
    rows = GLOBAL_ROWS // world
    shard = torch.zeros(rows, 4) + seed
    return {"model": model, "optim": optim, "shard": ss.Sharded(shard, (GLOBAL_ROWS, 4), (rows * rank, 0))}


def _train(state, rank, step):
    model, optim = state["model"], state["optim"]
    optim.zero_grad()
    g = torch.Generator().manual_seed(step * 10 + rank)
    model(torch.randn(4, 32, generator=g)).pow(2).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optim.step()
    with torch.no_grad():
        state["shard"].local.add_(torch.randn(state["shard"].local.shape, generator=g))


def _checkpointer(dirs, rank, world):
    os.environ["GROUP_RANK"] = str(_node(rank, world))
    return ss.Checkpointer(dirs["root"], local_root=dirs["local"][_node(rank, world)], local_every=1,
                           peer_replicas=1, persist_every=PERSIST_EVERY, host_memory_gb=0.02)


def _train_then_die(rank, world, dirs, out):
    state = _state(rank, world)
    ckpt = _checkpointer(dirs, rank, world)
    for step in range(1, STEPS + 1):
        _train(state, rank, step)
        if step in (PERSIST_EVERY, STEPS - 1, STEPS):
            torch.save(state["shard"].local.clone(), os.path.join(out, f"shard-{step}-{rank}.pt"))
            if rank == 0:
                torch.save(reference({"model": state["model"], "optim": state["optim"]}),
                           os.path.join(out, f"ref-{step}.pt"))
        handle = ckpt.save(step, state)
    handle.wait()  # resolves once step 13 is also committed in the node-local levels
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)  # no close(): every rank dies with its Checkpointer open


def _restore(rank, world, dirs, out):
    state = _state(rank, world, seed=7)
    ckpt = _checkpointer(dirs, rank, world)
    with pytest.warns(RuntimeWarning) if dirs.get("expect_warning") else _nothing():
        step = ckpt.load_latest(state)
    loaded_from = ckpt.loaded_from
    ckpt.close()
    ref = torch.load(os.path.join(out, f"ref-{step}.pt"))
    assert_state_equals({"model": state["model"], "optim": state["optim"]}, ref)
    shards = [torch.load(os.path.join(out, f"shard-{step}-{r}.pt")) for r in range(4)]
    rows = GLOBAL_ROWS // world
    assert torch.equal(state["shard"].local, torch.cat(shards)[rows * rank:rows * (rank + 1)])
    return step, loaded_from


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory):
    """Directories of a 4-rank job SIGKILLed after step 13, with node 1's level (in shm) wiped;
    trained once for the module, each restart works on its own copy."""
    tmp_path = tmp_path_factory.mktemp("killed")
    shm_name = f"statesnap-test-{uuid.uuid4().hex[:8]}"
    dirs = {"root": str(tmp_path / "root"), "local": [str(tmp_path / "node0"), f"shm://{shm_name}"]}
    out = str(tmp_path / "refs")
    os.makedirs(out)
    try:
        with pytest.raises(AssertionError) as killed:
            run_ranks(4, _train_then_die, dirs, out)
        assert str(killed.value).count("exited with code -9") == 4
        node1 = os.path.join(SHM_ROOT, shm_name)
        assert f"step-{STEPS}" in os.listdir(local_level(node1, dirs["root"]))
        shutil.rmtree(node1)  # node 1 is lost: its local level and its shared memory with it
        yield tmp_path, dirs, out
    finally:
        shutil.rmtree(os.path.join(SHM_ROOT, shm_name), ignore_errors=True)


def _copy(tmp_path, dirs, name):
    """A fresh copy of the killed job's directories for one restart (restarts change them)."""
    base = tmp_path / name
    shutil.copytree(dirs["root"], base / "root")
    # (node 0's level, under the name the job's new root gives it)
    shutil.copytree(local_level(dirs["local"][0], dirs["root"]), local_level(base / "node0", base / "root"))
    shm_name = f"{dirs['local'][1][len('shm://'):]}-{name}"
    return {"root": str(base / "root"), "local": [str(base / "node0"), f"shm://{shm_name}"]}, shm_name


@pytest.mark.parametrize("world", [4, 3])
def test_restart_after_node_loss_restores_from_the_peer_replica(killed_job, world):
    tmp_path, dirs, out = killed_job
    copy, shm_name = _copy(tmp_path, dirs, f"restart{world}")
    try:
        results = run_ranks(world, _restore, copy, out)
    finally:
        shutil.rmtree(os.path.join(SHM_ROOT, shm_name), ignore_errors=True)
    assert results == [(STEPS, "peer")] * world


def _restore_on_node_0(rank, world, dirs, out):
    """A rank of a restart on the one node left, configured as before (``peer_replicas=1``)."""
    os.environ["GROUP_RANK"] = "0"
    state = _state(rank, world, seed=7)
    with pytest.warns(RuntimeWarning, match="every rank is on node 0: no other node can keep replicas"):
        ckpt = ss.Checkpointer(dirs["root"], local_root=dirs["local"][0], local_every=1, peer_replicas=1,
                               persist_every=PERSIST_EVERY, host_memory_gb=0.02)
    step, loaded_from = ckpt.load_latest(state), ckpt.loaded_from
    ref = torch.load(os.path.join(out, f"ref-{step}.pt"))
    assert_state_equals({"model": state["model"], "optim": state["optim"]}, ref)
    shards = [torch.load(os.path.join(out, f"shard-{step}-{r}.pt")) for r in range(4)]
    rows = GLOBAL_ROWS // world
    assert torch.equal(state["shard"].local, torch.cat(shards)[rows * rank:rows * (rank + 1)])
    _train(state, rank, step + 1)  # and the run goes on, checkpointing on its node alone
    ckpt.save(step + 1, state).wait()
    ckpt.close()
    return step, loaded_from


def test_a_restart_on_the_node_left_restores_its_replicas_with_the_configuration_unchanged(killed_job):
    """Node 1 is gone and the job restarts on node 0 alone (2 ranks), still asking for
    peer_replicas=1: it warns that no replicas can be kept, restores the newest step from node 0's
    level (its own files and node 1's replicas), bit for bit, resharded from 4 ranks, and goes on."""
    tmp_path, dirs, out = killed_job
    copy, _ = _copy(tmp_path, dirs, "one-node")
    assert run_ranks(2, _restore_on_node_0, copy, out) == [(STEPS, "local")] * 2
    # (committed by the node's leader)
    assert f"step-{STEPS + 1}" in os.listdir(local_level(copy["local"][0], copy["root"]))


@pytest.mark.parametrize("damage, steps, expected", [
    ("flipped", (STEPS,), (STEPS - 1, "peer")),
    ("flipped", (STEPS, STEPS - 1), (PERSIST_EVERY, "persistent")),
    ("truncated", (STEPS, STEPS - 1), (PERSIST_EVERY, "persistent")),
])
def test_a_damaged_replica_falls_back_to_the_next_copy(killed_job, damage, steps, expected):
    """Flipped bits and a truncated file, sent to the replaced node, fail the verified load there:
    every rank goes on together to the step before from the replicas, and when that one is
    damaged too, to root."""
    tmp_path, dirs, out = killed_job
    copy, shm_name = _copy(tmp_path, dirs, f"damaged-{damage}-{len(steps)}")
    for step in steps:
        step_dir = os.path.join(local_level(copy["local"][0], copy["root"]), f"step-{step}")
        replica = next(n for n in os.listdir(step_dir) if n.endswith("-r00002.bin"))  # rank 2's, kept by rank 0
        data = bytearray(open(os.path.join(step_dir, replica), "rb").read())
        with open(os.path.join(step_dir, replica), "wb") as f:
            f.write(bytes(b ^ 0xFF for b in data) if damage == "flipped" else data[:len(data) // 2])
    copy["expect_warning"] = True
    try:
        results = run_ranks(4, _restore, copy, out)
    finally:
        shutil.rmtree(os.path.join(SHM_ROOT, shm_name), ignore_errors=True)
    assert results == [expected] * 4
    left = os.listdir(local_level(copy["local"][0], copy["root"]))
    assert not any(n.startswith(f"step-{step}") for step in steps for n in left)  # not tried again


def test_one_process_restores_from_the_local_level_before_root(tmp_path):
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    with ss.Checkpointer(tmp_path / "root", local_root=tmp_path / "local", host_memory_gb=0.01) as ckpt:
        for step in (1, 2):
            train_step(model, optim, step)
            ckpt.save(step, state)
        ref = reference(state)
    assert sorted(n for n in os.listdir(local_level(tmp_path / "local", tmp_path / "root"))
                  if n.startswith("step-")) == ["step-1", "step-2"]
    fresh = {"model": make_training(seed=5)[0], "optim": None}
    fresh["optim"] = torch.optim.AdamW(fresh["model"].parameters(), lr=1e-2)
    with ss.Checkpointer(tmp_path / "root", local_root=tmp_path / "local", host_memory_gb=0.01) as ckpt:
        assert ckpt.load_latest(fresh) == 2 and ckpt.loaded_from == "local"
    assert_state_equals(fresh, ref)


@pytest.mark.parametrize("damage", ["truncated manifest", "empty manifest", "data file deleted"])
def test_a_node_local_step_no_restore_can_take_is_named_not_passed_over(tmp_path, damage):
    """A node-local step whose manifest cannot be read, or whose data files are not all there,
    was left out of the restore's choices without a word (a flipped byte was warned of): the
    restart went back a step silently, and deleted the damaged step with those after it. Now
    it is named as any copy given up is, and with nothing older to take the restore raises."""
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    settings = dict(local_root=tmp_path / "local", persist_every=2, host_memory_gb=0.01)
    with ss.Checkpointer(tmp_path / "root", **settings) as ckpt:
        for step in range(1, 6):
            train_step(model, optim, step)
            ckpt.save(step, state)
            if step == 4:
                ref = reference(state)
    newest = Path(local_level(tmp_path / "local", tmp_path / "root")) / "step-5"
    manifest = newest / "manifest.json"
    if damage == "data file deleted":
        next(p for p in newest.iterdir() if p.name.endswith(".bin")).unlink()
    else:
        os.truncate(manifest, manifest.stat().st_size // 2 if damage == "truncated manifest" else 0)
    fresh_model = make_training(seed=5)[0]
    fresh = {"model": fresh_model, "optim": torch.optim.AdamW(fresh_model.parameters(), lr=1e-2)}
    with pytest.warns(RuntimeWarning, match="step 5 on the node-local level at .* cannot be restored .*; restoring "
                                            "step 4 from the local level"):
        with ss.Checkpointer(tmp_path / "root", **settings) as ckpt:
            assert ckpt.load_latest(fresh) == 4 and ckpt.loaded_from == "local"
    assert_state_equals(fresh, ref)
    with ss.Checkpointer(tmp_path / "other", local_root=tmp_path / "alone", persist_every=100,
                         host_memory_gb=0.01) as ckpt:
        ckpt.save(1, state).wait()
    os.truncate(Path(local_level(tmp_path / "alone", tmp_path / "other")) / "step-1" / "manifest.json", 0)
    with ss.Checkpointer(tmp_path / "other", local_root=tmp_path / "alone", persist_every=100,
                         host_memory_gb=0.01) as ckpt:
        with pytest.raises(ss.CorruptCheckpointError, match="no checkpoint can be restored: step 1 on the node-local "
                                                            "level at .* cannot be restored"):
            ckpt.load_latest(fresh)


def test_a_state_that_does_not_match_leaves_the_local_level_alone(tmp_path):
    """Only damage removes node-local steps: a restart with the wrong model is the user's to fix,
    and the steps must still be there once it is fixed."""
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    settings = dict(local_root=tmp_path / "local", host_memory_gb=0.01)
    with ss.Checkpointer(tmp_path / "root", **settings) as ckpt:
        for step in (1, 2):
            train_step(model, optim, step)
            ckpt.save(step, state)
    wrong = make_training(width=16)[0]
    with ss.Checkpointer(tmp_path / "root", **settings) as ckpt:
        with pytest.raises(ss.StateMismatchError):
            ckpt.load_latest({"model": wrong, "optim": torch.optim.AdamW(wrong.parameters())})
    assert sorted(n for n in os.listdir(local_level(tmp_path / "local", tmp_path / "root"))
                  if n.startswith("step-")) == ["step-1", "step-2"]


def _fresh_training():
    model = make_training(seed=5)[0]
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2)}


def test_an_unreachable_root_leaves_the_local_level_serving_until_it_is_back(tmp_path):
    """Storage outage: a root that cannot be claimed (here a path under a file) is raised without
    a local level; with one, the job starts, keeps its steps locally, restarts from them during
    the outage, and claims the root again at the first step due there once it is back."""
    blocked = tmp_path / "storage"
    blocked.write_text("the mount is gone")
    root, further, local = blocked / "root", blocked / "further", tmp_path / "local"
    with pytest.raises(ss.CheckpointError, match="cannot keep checkpoints under"):
        ss.Checkpointer(root, host_memory_gb=0.01)
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    settings = dict(local_root=local, persist_every=2, further_root=further, further_every=2, host_memory_gb=0.01)
    refs = {}
    with pytest.warns(RuntimeWarning, match="starting without the"):
        ckpt = ss.Checkpointer(root, **settings)
    with ckpt:
        for step in (1, 2, 3):
            train_step(model, optim, step)
            refs[step] = reference(state)
            ckpt.save(step, state).wait()
        assert ckpt.stats()["committed"] == 0 and ckpt.stats()["failed"] == 0
    assert sorted(n for n in os.listdir(local_level(local, root)) if n.startswith("step-")) == ["step-2", "step-3"]

    with pytest.warns(RuntimeWarning, match="starting without the"):
        restarted = ss.Checkpointer(root, **settings)  # a restart while the storage is still out
    fresh = _fresh_training()
    with restarted:
        assert restarted.load_latest(fresh) == 3 and restarted.loaded_from == "local"
        assert_state_equals(fresh, refs[3])
        blocked.unlink()
        blocked.mkdir()  # the storage is back
        for step in (4, 5, 6):
            train_step(fresh["model"], fresh["optim"], step)
            refs[step] = reference(fresh)
            restarted.save(step, fresh).wait()
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-4", "step-6"]
    assert sorted(n for n in os.listdir(further) if n.startswith("step-")) == ["step-4", "step-6"]
    for name in ("root", "further"):
        loaded = _fresh_training()
        ss.load(loaded, blocked / name / "step-6")
        assert_state_equals(loaded, refs[6])


def test_peer_replicas_need_two_nodes(tmp_path):
    """On one node (one host) there is no partner: a warning, and the run goes on without replicas."""
    with pytest.warns(RuntimeWarning, match="no other node can keep replicas, so this run keeps none"):
        ckpt = ss.Checkpointer(tmp_path / "root", local_root=tmp_path / "local", peer_replicas=1, node_id=0)
    assert ckpt.config.peer_replicas == 0
    ckpt.save(1, {"w": torch.ones(3)}).wait()
    ckpt.close()
    assert "step-1" in os.listdir(local_level(tmp_path / "local", tmp_path / "root"))
    assert "step-1" in os.listdir(tmp_path / "root")
    with pytest.raises(ss.CheckpointError, match="needs local_root"):
        ss.Checkpointer(tmp_path / "root", peer_replicas=1)


def _pickled_value_job(rank, world, root, local_roots, restart):
    """Save (or, ``restart``, restore) a state holding a pickled value, as node ``rank``."""
    os.environ["GROUP_RANK"] = str(rank)
    state = {"a": ss.Sharded(torch.full((2, 3), float(rank if not restart else -1)), (4, 3), (2 * rank, 0)),
             "extra": {"seen": {10, 11} if not restart else None}}
    with ss.Checkpointer(root, local_root=local_roots[rank], peer_replicas=1, persist_every=10,
                         host_memory_gb=0.02, allow_pickle=True) as ckpt:
        if not restart:
            ckpt.save(1, state).wait()
            return None
        step = ckpt.load_latest(state)
        return step, ckpt.loaded_from, state["extra"]["seen"], state["a"].local.tolist()


def test_a_peer_restore_reads_a_pickled_value_once_its_file_has_arrived(tmp_path):
    """A pickled value's bytes are in a data file that the node which lost its level fetches from
    the partner: they are read after the fetch (read before it, the restore failed, and the
    step, given up, was deleted from the node-local level)."""
    root, local_roots = str(tmp_path / "root"), [str(tmp_path / f"node{n}") for n in range(2)]
    run_ranks(2, _pickled_value_job, root, local_roots, False)
    shutil.rmtree(local_roots[1])  # node 1 is lost
    assert run_ranks(2, _pickled_value_job, root, local_roots, True) == [
        (1, "peer", {10, 11}, [[0.0] * 3] * 2), (1, "peer", {10, 11}, [[1.0] * 3] * 2)]
    assert "step-1" in os.listdir(local_level(local_roots[0], root))


def _one_node_id_on_two_hosts(rank, world, root):
    import socket

    socket.gethostname = lambda: f"host-{rank}"  # (as two machines would answer)
    try:
        ss.Checkpointer(os.path.join(root, "root"), local_root=os.path.join(root, f"local{rank}"), peer_replicas=1,
                        node_id=0)
    except ss.CheckpointError as exc:
        return str(exc)
    return None


def test_ranks_on_two_hosts_that_report_one_node_are_refused(tmp_path):
    """GROUP_RANK unset on a job of two machines: every rank says node 0. That is no one-node
    restart, and taking two machines' local levels for one would be wrong: refused, saying what to set."""
    errors = run_ranks(2, _one_node_id_on_two_hosts, str(tmp_path))
    assert all(e is not None and "every rank says it is on node 0, on 2 hosts: set GROUP_RANK" in e for e in errors)


@pytest.mark.parametrize("local", ["disk", "shm"])
def test_recovery_bench_runs_and_checks_both_sources(tmp_path, local):
    from statesnap.bench import recovery

    result = recovery.run(ranks=2, mb_per_rank=0.1, repeat=1, out=str(tmp_path), local=local)
    assert set(result["seconds"]) == {"peer", "root"} and result["root_vs_peer"] > 0
    assert result["local"] == local and f"levels on {local}" in recovery.report(result)
    assert not (tmp_path / "recovery").exists(), "the scratch checkpoints must be removed"
    for root in result["local_roots"]:
        assert root.startswith("shm://" if local == "shm" else str(tmp_path))
        assert not os.path.exists(normalize(root))


def _replica_faults(rank, world, root, local_roots):
    """Step 2: rank 1 cannot write rank 0's replica (its disk fails mid-stream). Step 3: rank 0
    cannot produce what it sends. Neither may leave its partner waiting: both steps fail on the
    node-local level at once, on both ranks, and steps 1 and 4 commit there."""
    from statesnap.checkpointer import local as local_stage
    from statesnap.storage.local import LocalBackend

    real_open_write, real_ranges = LocalBackend.open_write, local_stage.LocalFlusher._own_ranges

    def open_write(self, path, durable=False):
        writer = real_open_write(self, path, durable)
        if rank == 1 and "step-2" in path and path.endswith("-r00000.bin"):
            def fail(offset, views):
                raise OSError(28, "No space left on device", path)
            writer.pwrite = fail
        return writer

    def own_ranges(self, snap, staging, output):
        if rank == 0 and snap.step == 3:
            raise OSError(5, "Input/output error", staging)
        return real_ranges(self, snap, staging, output)

    LocalBackend.open_write, local_stage.LocalFlusher._own_ranges = open_write, own_ranges
    os.environ["GROUP_RANK"] = str(rank)
    state = _state(rank, world)
    with pytest.warns(RuntimeWarning) as caught:
        ckpt = ss.Checkpointer(root, local_root=local_roots[rank], peer_replicas=1, persist_every=10,
                               host_memory_gb=0.02, on_error="warn", commit_timeout_s=60)
        for step in range(1, 5):
            _train(state, rank, step)
            ckpt.save(step, state).wait()
        ckpt.close()
    steps = sorted(n for n in os.listdir(local_level(local_roots[rank], root)) if n.startswith("step-"))
    return steps, [str(w.message) for w in caught]


def test_a_replica_transfer_failing_on_either_side_fails_that_step_without_a_hang(tmp_path):
    roots = [str(tmp_path / f"node{n}") for n in range(2)]
    for steps, warned in run_ranks(2, _replica_faults, str(tmp_path / "root"), roots):
        assert steps == ["step-1", "step-4"], steps
        assert any("step 2" in w and "No space left" in w for w in warned), warned
        assert any("step 3" in w and "Input/output error" in w for w in warned), warned


def _stream_with_a_failure(rank, world, failing):
    """Rank 0 streams 4 chunks to rank 1; ``failing`` says which side fails at the second chunk.
    Both sides must get through the whole stream (the next message arrives in order) and only
    the failing side raises."""
    from statesnap.checkpointer import local as local_stage

    local_stage.PEER_CHUNK_BYTES = 1024
    data = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    raised = None
    try:
        if rank == 0:
            def read(offset, nbytes):
                if failing == "sender" and offset >= 1024:
                    raise OSError(5, "Input/output error")
                return data[offset:offset + nbytes]
            local_stage.send_stream(None, 1, [(0, 4096)], read)
        else:
            received = torch.zeros(4096, dtype=torch.uint8)

            def write(offset, view):
                if failing == "receiver" and offset >= 1024:
                    raise OSError(28, "No space left on device")
                received[offset:offset + view.numel()] = view
            local_stage.recv_stream(None, 0, torch.empty(1024, dtype=torch.uint8), write)
    except OSError as exc:
        raised = exc.strerror
    marker = torch.tensor([7 + rank])
    dist.all_reduce(marker)  # the streams are drained: the next collective pairs up
    return raised, int(marker)


@pytest.mark.parametrize("failing", ["sender", "receiver"])
def test_a_stream_that_fails_halfway_is_still_drained(failing):
    results = run_ranks(2, _stream_with_a_failure, failing)
    expected = {"sender": ["Input/output error", None], "receiver": [None, "No space left on device"]}[failing]
    assert [raised for raised, _ in results] == expected
    assert [marker for _, marker in results] == [15, 15]


def _fetch_file(rank, world, directory, mappable, in_flight):
    """Rank 0 sends a file of 5.5 chunks as a restore's fetch does (from the page cache, or read
    into a buffer's slots in turn where the backend maps nothing or mapping fails); rank 1
    writes what arrives while the next chunks come in, into the other slots of its buffer."""
    from statesnap.checkpointer import local as local_stage
    from statesnap.checkpointer import recovery
    from statesnap.storage.local import LocalBackend

    chunk = 4096
    local_stage.PEER_CHUNK_BYTES, local_stage.IN_FLIGHT = chunk, in_flight
    backend = LocalBackend()
    if mappable is not True:
        opened = backend.open_read
        backend.open_read = lambda path: _Unmapped(opened(path), fails=mappable == "fails")
    fetch = recovery.LocalRecovery(type("Level", (), {"backend": backend})(), None, None, durable=False)
    source, copy = os.path.join(directory, "source"), os.path.join(directory, f"copy-{mappable}")
    failures = []
    if rank == 0:
        fetch._send(None, 1, source, failures)
        return failures
    buffers = []
    writer = backend.open_write(copy, False)

    def write(offset, view):
        buffers.append(view.data_ptr())
        writer.pwrite(offset, [memoryview(view.numpy())])
    assert local_stage.recv_stream(None, 0, local_stage.stream_buffer(), write)
    writer.close(False)
    with open(source, "rb") as a, open(copy, "rb") as b:
        return a.read() == b.read(), len(set(buffers))


class _Unmapped:
    """A reader whose backend cannot map files (an object store's), or whose mapping fails (no
    room under a strict overcommit policy)."""

    def __init__(self, reader, fails):
        self.reader, self.fails = reader, fails

    def map(self, offset, nbytes):
        if self.fails:
            raise OSError(12, "Cannot allocate memory")
        return None

    def __getattr__(self, name):
        return getattr(self.reader, name)


@pytest.mark.parametrize("mappable,in_flight", [(True, 2), (False, 2), ("fails", 2), (False, 3)])
def test_a_fetch_streams_chunks_in_flight_bit_exact(tmp_path, mappable, in_flight):
    with open(tmp_path / "source", "wb") as f:
        f.write(torch.randint(0, 256, (4096 * 5 + 2048,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
                .numpy().tobytes())
    sent, (same, distinct_buffers) = run_ranks(2, _fetch_file, str(tmp_path), mappable, in_flight)
    assert sent == [] and same
    assert distinct_buffers == in_flight  # the buffer's slots, in turn


def test_a_step_is_complete_only_where_one_commit_of_it_is_held_whole():
    """Inventories carry each node's own files and a digest of the names, never the job's list.
    A node holding another commit of the same step (another run's) does not complete it."""
    from statesnap.checkpointer.recovery import complete_steps, copy_of

    names = ["data-a-r00000.bin", "data-a-r00001.bin", "data-a-r00002.bin", "data-a-r00003.bin"]
    ours, theirs = (4, 11), (4, 22)
    node0 = {5: (names[:2], *ours), 6: (names[:2], *ours)}
    node1 = {5: (names[2:], *ours), 6: (["data-b-r00002.bin", "data-b-r00003.bin"], *theirs)}
    inventories = [node0, node0, node1, node1]
    assert complete_steps(inventories) == [5]
    assert copy_of(inventories, 5) == ours and copy_of(inventories, 6) is None
    partner = {6: (names[2:], *ours)}  # a peer replica of node 1's files on a third node
    assert complete_steps(inventories + [partner]) == [6, 5]
    assert copy_of([node0, node0], 5) is None


def test_a_fill_reads_a_file_as_it_arrives_and_fails_when_its_transfer_does(tmp_path):
    """A restore's fill reads the files its rank receives while they arrive: each read waits for
    its range to be written, gets exactly those bytes, and a transfer that fails or stops before
    the range comes fails the read with the file named, instead of leaving it waiting."""
    import threading

    from statesnap.checkpointer.arrivals import Arrivals
    from statesnap.checkpointer.local import pwriter
    from statesnap.storage.local import LocalBackend

    backend, directory = LocalBackend(), str(tmp_path)
    (tmp_path / "held.bin").write_bytes(b"h" * 10)
    arrivals = Arrivals(["a.bin", "b.bin", "c.bin"])
    view = arrivals.backend(backend, directory)
    writer = backend.open_write(str(tmp_path / "a.bin"), False)
    write = arrivals.recorded("a.bin", str(tmp_path / "a.bin"), pwriter(writer))
    got, errors = {}, {}

    def read(name, offset, nbytes):
        reader = view.open_read(os.path.join(directory, name))
        buf = bytearray(nbytes)
        try:
            reader.readinto(offset, [memoryview(buf)])
            got[name] = bytes(buf)
        except ss.CheckpointError as exc:
            errors[name] = str(exc)
        finally:
            reader.close()
    readers = [threading.Thread(target=read, args=args) for args in
               [("a.bin", 4, 8), ("b.bin", 0, 4), ("c.bin", 0, 4), ("held.bin", 2, 3)]]
    for thread in readers:
        thread.start()
    write(0, torch.arange(8, dtype=torch.uint8))
    readers[0].join(0.2)
    assert readers[0].is_alive(), "bytes 4-12 are not all written yet"
    write(8, torch.arange(8, 16, dtype=torch.uint8))
    readers[0].join(5)
    assert got["a.bin"] == bytes(range(4, 12))
    arrivals.ended("a.bin")  # received whole: 16 bytes
    arrivals.ended("b.bin", "OSError: [Errno 28] No space left on device")
    arrivals.end_all("the transfers stopped")
    for thread in readers:
        thread.join(5)
        assert not thread.is_alive()
    writer.close(False)
    assert errors["b.bin"] == "b.bin could not be fetched from another node: OSError: [Errno 28] No space left on device"
    assert errors["c.bin"] == "c.bin could not be fetched from another node: the transfers stopped"
    assert got["held.bin"] == b"hhh"  # a file the node already held is read as it is
    # (all that was sent, short of what the load reads: the sender's copy is truncated, damage a restart may go past)
    with pytest.raises(ss.CorruptCheckpointError, match=r"a.bin fetched from another node is truncated: its "
                                                         r"transfer ended at byte 16, before 20"):
        view.open_read(os.path.join(directory, "a.bin")).readinto(12, [memoryview(bytearray(8))])


def test_a_removed_step_is_restored_from_no_level(tmp_path):
    """remove(N) of the newest step: load_latest brings back N-1, not N from host memory, the
    node-local level or the further level, each of which held N too."""
    root, local, further = tmp_path / "root", tmp_path / "local", tmp_path / "further"
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    refs = {}
    with ss.Checkpointer(root, local_root=local, further_root=further, further_every=1,
                         host_memory_gb=0.01) as ckpt:
        for step in (1, 2):
            train_step(model, optim, step)
            refs[step] = reference(state)
            ckpt.save(step, state).wait()
        ckpt.remove(2)
        for level in (root, local_level(local, root), further):
            assert sorted(n for n in os.listdir(level) if n.startswith("step-")) == ["step-1"], level
        fresh = _fresh_training()
        assert ckpt.load_latest(fresh) == 1  # (from memory, which held both steps)
        assert_state_equals(fresh, refs[1])
        ckpt.remove(7)  # nothing there: nothing to do


def test_removing_a_step_while_the_further_level_is_out_warns(tmp_path):
    """A level started without (unreachable) cannot be cleaned: remove() says so, rather than
    failing with the storage's error after the persistent copy is gone, or staying silent."""
    blocked = tmp_path / "storage"
    blocked.write_text("the mount is gone")
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    with pytest.warns(RuntimeWarning, match="starting without the further level"):
        ckpt = ss.Checkpointer(tmp_path / "root", local_root=tmp_path / "local", further_root=blocked / "further",
                               further_every=1, host_memory_gb=0.01)
    with ckpt:
        for step in (1, 2):
            train_step(model, optim, step)
            ckpt.save(step, state).wait()
        with pytest.warns(RuntimeWarning, match="step 2 was not removed from the further level"):
            ckpt.remove(2)
    assert sorted(n for n in os.listdir(tmp_path / "root") if n.startswith("step-")) == ["step-1"]


def _save_with_an_empty_piece(rank, world, root, local_roots):
    os.environ["GROUP_RANK"] = str(rank)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 3, generator=g), torch.randn(1, 3, generator=g)
    # rank 1 holds no row of b: its empty piece starts where its part of a does in its data file
    state = {"a": ss.Sharded(a[2 * rank:2 * rank + 2].clone(), (4, 3), (2 * rank, 0)),
             "b": ss.Sharded(b[rank:1].clone(), (1, 3), (rank, 0))}
    with ss.Checkpointer(root, local_root=local_roots[rank], peer_replicas=1, persist_every=10,
                         host_memory_gb=0.02) as ckpt:
        ckpt.save(1, state).wait()
    return a, b


def test_a_replica_of_a_file_beside_an_empty_piece_is_the_file_itself(tmp_path, monkeypatch):
    """The replica a partner node wrote of a rank holding an empty piece had zeros where the
    rank's other tensors were (the empty piece's place in the arena was sent for its neighbour's
    bytes): the node-loss restart found it damaged and went back to an older step."""
    roots = [str(tmp_path / f"node{n}") for n in range(2)]
    (a, b), _ = run_ranks(2, _save_with_an_empty_piece, str(tmp_path / "root"), roots)
    levels = [local_level(root, tmp_path / "root") for root in roots]
    own, replica = ([p for p in os.listdir(os.path.join(level, "step-1")) if p.endswith("-r00001.bin")]
                    for level in (levels[1], levels[0]))
    assert own == replica and len(own) == 1
    with open(os.path.join(levels[1], "step-1", own[0]), "rb") as f, \
            open(os.path.join(levels[0], "step-1", own[0]), "rb") as g:
        assert f.read() == g.read()
    shutil.rmtree(roots[1])  # node 1 is lost: node 0 restores both ranks' parts from its own level
    monkeypatch.setenv("GROUP_RANK", "0")
    state = {"a": torch.zeros(4, 3), "b": torch.zeros(1, 3)}
    with ss.Checkpointer(tmp_path / "root", local_root=roots[0], persist_every=10, host_memory_gb=0.02) as ckpt:
        assert ckpt.load_latest(state) == 1 and ckpt.loaded_from == "local"
    assert torch.equal(state["a"], a) and torch.equal(state["b"], b)


def _uneven_fit(rank, world, root, local_root):
    """Rank 0's snapshot (1.6 MB) does not fit a 1.5 MB budget, rank 1's (64 KiB) does."""
    numel = 400_000 if rank == 0 else 16_384
    shard = torch.zeros(numel)
    state = {"shard": ss.Sharded(shard, (416_384,), (0 if rank == 0 else 400_000,))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = ss.Checkpointer(root, local_root=local_root, local_every=1, persist_every=2, host_memory_gb=0.0015,
                               on_error="warn", commit_timeout_s=30)
        for step in range(1, 6):
            shard.fill_(step)
            ckpt.save(step, state)
        ckpt.close()
    fresh = torch.full((numel,), -1.0)
    ss.load({"shard": ss.Sharded(fresh, (416_384,), (0 if rank == 0 else 400_000,))}, os.path.join(root, "step-4"))
    return [str(w.message) for w in caught], bool((fresh == 4).all())


def test_ranks_skip_the_steps_one_cannot_keep_in_memory_together(tmp_path):
    """A step that is not persisted and does not fit one rank's host memory is skipped by every
    rank: one skipping it alone sent the others' copy to the node-local level, whose collectives
    then paired different steps on the ranks ('out of step') at every later save, waiting
    commit_timeout_s at each, and lost persisted steps too."""
    results = run_ranks(2, _uneven_fit, str(tmp_path / "root"), str(tmp_path / "local"))
    for rank, (warned, loaded) in enumerate(results):
        assert loaded, rank
        assert not any("out of step" in w or "did not" in w for w in warned), warned
        fits = "another rank's state does not fit" if rank else "the state does not fit"
        assert sum(fits in w for w in warned) == 1, warned
        # the node-local level copies from a whole snapshot in memory: persisted steps fail there, named
        assert any("does not fit in host memory whole" in w for w in warned), warned
    assert sorted(n for n in os.listdir(tmp_path / "root") if n.startswith("step-")) == ["step-2", "step-4"]


def _per_rank_values_unwrapped(rank, world, root, local_root, wrapped, sampled):
    os.environ["GROUP_RANK"] = str(rank)  # two nodes
    rng = torch.full((1024,), float(rank))  # 4 KiB: sampled where replica_check_mb is below that
    state = {"w": torch.ones(4), "rng": ss.PerRank(rng) if wrapped else rng,
             "pos": ss.PerRank(10 + rank) if wrapped else 10 + rank}
    settings = dict(local_root=f"{local_root}/n{rank}", local_every=1, persist_every=1000, host_memory_gb=0.02,
                    on_error="warn", commit_timeout_s=30, replica_check_mb=0.001 if sampled else 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ss.Checkpointer(root, **settings) as ckpt:
            ckpt.save(1, state).wait()
    fresh = torch.zeros(1024)
    target = {"w": torch.zeros(4), "rng": ss.PerRank(fresh) if wrapped else fresh,
              "pos": ss.PerRank(-1) if wrapped else -1}
    with ss.Checkpointer(root, **settings) as ckpt:
        step = ckpt.load_latest(target)
    rng, pos = (target["rng"].value, target["pos"].value) if wrapped else (fresh, target["pos"])
    return [str(w.message) for w in caught], step, bool((rng == rank).all()), pos


@pytest.mark.parametrize("sampled", [False, True])
def test_the_node_local_level_refuses_per_rank_values_stored_as_one_as_the_persistent_level_does(tmp_path, sampled):
    """The node-local level stores one copy of a replicated tensor or shared value and restores
    it to every rank, as the persistent level does, but it compared nothing: a per-rank RNG
    state and position not wrapped in ss.PerRank came back on every rank as one rank's, without a
    word. Its commit now compares them (large ones by samples), and refuses what differs."""
    for wrapped in (False, True):
        results = run_ranks(2, _per_rank_values_unwrapped, str(tmp_path / f"root{wrapped}"),
                            str(tmp_path / f"local{wrapped}"), wrapped, sampled)
        for rank, (warned, step, own_rng, pos) in enumerate(results):
            if wrapped:
                assert not warned and step == 1 and own_rng and pos == 10 + rank, (warned, step)
            else:
                assert step is None, step
                assert any("node-local checkpoint of step 1" in w and "replicated value(s) differ" in w
                           and "rng" in w and "pos" in w for w in warned), warned
