"""The Checkpointer on two real gloo ranks: DDP-style replicas, sharded and per-rank state,
gradient all-reduces on the trainer's group while commits run on the Checkpointer's own group."""
import importlib
import os
import shutil
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import statesnap as ss
from dist_utils import run_ranks
from statesnap.storage.local import LocalBackend
from test_checkpointer import SlowBackend, assert_state_equals, make_training, reference


def _train(model, optim, seed, rank):
    optim.zero_grad()
    g = torch.Generator().manual_seed(seed * 10 + rank)  # each rank its own data
    model(torch.randn(4, 32, generator=g)).pow(2).sum().backward()
    for p in model.parameters():  # DDP by hand: the trainer's collectives on the default group
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optim.step()


def _state(rank, seed=0):
    model, optim = make_training(seed)  # same seed: replicated parameters
    shard = torch.arange(8, dtype=torch.float32) + 100 * rank
    return {"model": model, "optim": optim, "shard": ss.Sharded(shard, (16,), (8 * rank,)),
            "rank_value": ss.PerRank(torch.tensor([rank]))}


def _save_and_restore(rank, world, root):
    state = _state(rank)
    model, optim = state["model"], state["optim"]
    ckpt = ss.Checkpointer(root, keep_last=2, persist_every=2, host_memory_gb=0.01,
                           backend=SlowBackend(seed=rank, max_sleep=0.02))
    refs = {}
    for step in range(1, 6):
        _train(model, optim, step, rank)
        with torch.no_grad():
            state["shard"].local.add_(1)
        refs[step] = reference(state)
        ckpt.save(step, state)
    ckpt.wait_staged()
    _train(model, optim, 99, rank)
    assert ckpt.load_latest(state) == 5 and ckpt.loaded_from == "memory"
    assert_state_equals(state, refs[5])
    ckpt.close()
    files = sorted(f for f in os.listdir(os.path.join(root, "step-4")) if f.endswith(".bin"))

    fresh = _state(rank, seed=7)
    restarted = ss.Checkpointer(root, persist_every=2, host_memory_gb=0.01)
    step = restarted.load_latest(fresh)
    assert restarted.loaded_from == "persistent"
    restarted.close()
    assert_state_equals(fresh, refs[4])
    whole = ss.open(os.path.join(root, "step-4")).read("shard") if rank == 0 else None
    return step, len(files), int(fresh["rank_value"].value[0]), whole


@pytest.mark.parametrize("hash_seeds", [None, [21, 22]], ids=["forked", "own string hashes"])
def test_two_ranks_save_commit_and_restore(tmp_path, hash_seeds):
    """Also with ranks whose sets of strings iterate in different orders (see run_ranks)."""
    root = str(tmp_path / "ckpt")
    results = run_ranks(2, _save_and_restore, root, hash_seeds=hash_seeds)
    for rank, (step, files, rank_value, _) in enumerate(results):
        assert step == 4
        assert files == 2  # both ranks wrote a share of the replicated model
        assert rank_value == rank
    expected = torch.cat([torch.arange(8.0) + 4, torch.arange(8.0) + 104])
    assert torch.equal(results[0][3], expected)
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-2", "step-4"]


class OwnFilesOnly(LocalBackend):
    """A persistent level on which a rank can read only the data files (and manifest sections) it
    wrote, as on node-local disks; ``fail_step`` makes this rank's reads of that step fail (a lost
    disk)."""

    def __init__(self, rank, fail_step=None):
        self.rank, self.fail_step = rank, fail_step

    def open_read(self, path):
        name = os.path.basename(path)
        if name.endswith((".bin", ".sec")) and not name[:-4].endswith(f"-r{self.rank:05d}"):
            raise PermissionError(f"rank {self.rank} read another rank's file {path}")
        if self.fail_step is not None and f"step-{self.fail_step}" in path:
            raise OSError(f"rank {self.rank}: the disk under {path} is gone")
        return super().open_read(path)


def _copy_to_further(rank, world, root, further, fail_step, split=False):
    if split:  # this small job writes the split manifest a job of 64 ranks writes
        importlib.import_module("statesnap.engine.save").SPLIT_MIN_RANKS = 1
    state = _state(rank)
    model, optim = state["model"], state["optim"]
    refs = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = ss.Checkpointer(root, keep_last=1, further_root=further, further_every=2, further_keep_last=2,
                               host_memory_gb=0.01, on_error="warn",
                               backend=OwnFilesOnly(rank, fail_step if rank == 1 else None))
        for step in range(1, 7):
            _train(model, optim, step, rank)
            with torch.no_grad():
                state["shard"].local.add_(1)
            refs[step] = reference(state)
            ckpt.save(step, state).wait()
        ckpt.close()
    steps = sorted(n for n in os.listdir(further) if n.startswith("step-"))
    for name in steps:
        fresh = _state(rank, seed=7)
        ss.load(fresh, os.path.join(further, name))
        assert_state_equals(fresh, refs[int(name[5:])])
    return steps, [str(w.message) for w in caught if "further" in str(w.message) or "copy" in str(w.message)]


@pytest.mark.parametrize("split", [False, True])
def test_every_rank_copies_its_own_files_to_the_further_level(tmp_path, split):
    """No rank reads another's files (OwnFilesOnly refuses it), and the copy is one commit; with
    a split manifest each rank also copies the section it wrote."""
    root, further = str(tmp_path / "ckpt"), str(tmp_path / "further")
    for steps, warned in run_ranks(2, _copy_to_further, root, further, None, split):
        assert steps == ["step-4", "step-6"] and warned == []
    files = sorted(f for f in os.listdir(os.path.join(further, "step-6")) if f.endswith(".bin"))
    assert [f[-10:] for f in files] == ["r00000.bin", "r00001.bin"]
    sections = sorted(f[-10:] for f in os.listdir(os.path.join(further, "step-6")) if f.endswith(".sec"))
    assert sections == (["r00000.sec", "r00001.sec"] if split else [])


def test_a_rank_failing_its_further_copy_leaves_no_partial_copy(tmp_path):
    """Rank 1 cannot read step 4: neither rank commits it, both hear why, the other copies stay."""
    root, further = str(tmp_path / "ckpt"), str(tmp_path / "further")
    for steps, warned in run_ranks(2, _copy_to_further, root, further, 4):
        assert steps == ["step-2", "step-6"]
        assert len(warned) == 1 and "step 4" in warned[0] and "rank 1" in warned[0], warned
    assert not [n for n in os.listdir(further) if n.startswith(".step-")]  # no staging left behind


def _layout_changes_on_one_rank_only(rank, world, root):
    state = {"w": ss.Sharded(torch.full((2,), float(rank)), (2 * world,), (2 * rank,))}
    # not durable: the healthy collectives before the one this test lets time out wait on no fsync
    ckpt = ss.Checkpointer(root, commit_timeout_s=5, host_memory_gb=0.01, durable=False)
    ckpt.save(1, state).wait()
    message = None
    if rank == 0:
        state["late"] = torch.ones(3)  # like an optimizer state created at a later step on this rank only
        try:
            ckpt.save(2, state)
        except ss.CheckpointError as exc:
            message = str(exc)
    dist.barrier()
    ckpt.close()
    return message


def test_a_layout_change_on_one_rank_only_is_explained_not_left_hanging(tmp_path):
    """The ranks plan a new layout together; a rank whose layout changed alone waits for the others
    only until commit_timeout_s, then says what happened and what to do."""
    messages = run_ranks(2, _layout_changes_on_one_rank_only, str(tmp_path / "ckpt"))
    assert messages[1] is None
    assert "changed layout" in messages[0] and "optimizer" in messages[0] and "same save" in messages[0]
    assert ss.open(str(tmp_path / "ckpt" / "step-1")).read("w").tolist() == [0.0, 0.0, 1.0, 1.0]


def _a_target_refused_on_one_rank(rank, world, root):
    """Rank 1 loads into an expanded view (refused by name before anything is copied); rank 0's
    state is fine. Returns each rank's error type and the seconds it took to get it."""
    import time

    ckpt = ss.Checkpointer(root, host_memory_gb=0.01, durable=False, commit_timeout_s=120)
    ckpt.save(1, {"w": torch.arange(4.0)}).wait()
    target = {"w": torch.zeros(1).expand(4) if rank == 1 else torch.zeros(4)}
    started = time.perf_counter()
    try:
        ckpt.load_latest(target)
        outcome = None
    except ss.CheckpointError as exc:
        outcome = type(exc).__name__, str(exc)
    seconds = time.perf_counter() - started
    ckpt.close()
    return outcome, seconds


def test_a_target_refused_on_one_rank_stops_every_rank_at_once(tmp_path):
    """A state refused on one rank only (an expanded view there) was raised on that rank alone,
    while the other waited for it in the next exchange: until the collective timeout had the
    refusing rank gone on, or, when it left, with a PeerLostError that said nothing of why. Both
    now raise at once, the other naming the rank that refused and its reason."""
    outcomes = run_ranks(2, _a_target_refused_on_one_rank, str(tmp_path / "ckpt"))
    (remote, remote_s), (refused, refused_s) = outcomes
    assert refused[0] == "CheckpointError" and "expanded view" in refused[1]
    assert remote[0] == "RemoteFailure" and "rank 1" in remote[1] and "expanded view" in remote[1]
    assert max(refused_s, remote_s) < 60  # (the timeout would be 120 s)


class _Experts(torch.nn.Module):
    """A shared layer, replicated, and two experts of this rank's own (expert parallel: their
    names differ by rank, so each rank saves its own); ``forward(x, expert)`` routes every
    token to one."""

    def __init__(self, rank=0):
        super().__init__()
        torch.manual_seed(3)
        self.shared = torch.nn.Linear(8, 8)
        self.experts = torch.nn.ModuleDict({f"r{rank}e{i}": torch.nn.Linear(8, 8) for i in range(2)})

    def forward(self, x, expert):
        return list(self.experts.values())[expert](self.shared(x))


def _experts_reached_at_different_steps(rank, world, root):
    """Rank 0's expert 1 gets its first token at step 2, rank 1's at step 4, so the ranks'
    optimizers create those experts' states at different steps."""
    model = _Experts(rank)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim}
    ckpt = ss.Checkpointer(root, commit_timeout_s=20, host_memory_gb=0.02, durable=False, keep_last=10)
    first_token = 2 if rank == 0 else 4
    g = torch.Generator().manual_seed(rank)
    for step in range(1, 6):
        optim.zero_grad()
        expert = 1 if step >= first_token else 0
        model(torch.randn(4, 8, generator=g), expert).pow(2).sum().backward()
        for p in model.shared.parameters():  # the replicated layer: DDP by hand
            dist.all_reduce(p.grad)
            p.grad /= world
        optim.step()
        logged = [optim.state[p].get("step") for p in model.parameters()]  # leaves {} where none yet
        assert (None in logged) == (step == 1)  # no state for expert 1 until the first save makes it
        ckpt.save(step, state).wait()
    live = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {n: optim.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    steps = {n: float(optim.state[p]["step"]) for n, p in model.named_parameters()}
    ckpt.close()
    fresh = _Experts(rank)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    reader = ss.Checkpointer(root, durable=False)
    reader.load_latest({"model": fresh, "optim": fresh_optim})
    reader.close()
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in live.items())
    assert all(torch.equal(fresh_optim.state[p]["exp_avg"], moments[n]) for n, p in fresh.named_parameters())
    return steps, sorted(os.listdir(root))


def test_experts_reached_at_different_steps_on_different_ranks_still_checkpoint_every_step(tmp_path):
    """Each rank's optimizer creates an expert's state at that expert's first token, which ranks
    reach at different steps. Every save commits, and the last loads back exactly."""
    results = run_ranks(2, _experts_reached_at_different_steps, str(tmp_path / "ckpt"))
    (steps0, listed), (steps1, _) = results
    assert [n for n in listed if n.startswith("step-")] == [f"step-{s}" for s in range(1, 6)]
    assert steps0["experts.r0e1.weight"] == 4 and steps1["experts.r1e1.weight"] == 2  # the steps it had a gradient
    assert steps0["experts.r0e0.weight"] == 1 and steps1["experts.r1e0.weight"] == 3


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "AdamW-amsgrad"])
def test_adam_state_created_ahead_trains_exactly_as_state_created_at_the_first_gradient(kind):
    """The state given ahead (zero moments, step 0) is what the optimizer makes itself at a
    parameter's first gradient: training with it is bit for bit the same, and state that
    exists is left as it is."""
    from statesnap.state.flatten import create_adam_state

    def run(ahead):
        model = _Experts()
        cls = torch.optim.Adam if kind == "Adam" else torch.optim.AdamW
        optim = cls(model.parameters(), lr=0.05, weight_decay=0.1, amsgrad=kind.endswith("amsgrad"))
        g = torch.Generator().manual_seed(7)
        kept = None
        for step in range(6):
            optim.zero_grad()
            model(torch.randn(4, 8, generator=g), int(step >= 3)).pow(2).sum().backward()
            optim.step()
            if ahead and step == 0:
                kept = {id(v) for p in model.experts.r0e0.parameters() for v in optim.state[p].values()}
                create_adam_state(optim)
                created = optim.state[model.experts.r0e1.weight]
                assert float(created["step"]) == 0 and not created["exp_avg"].any()
                assert kept == {id(v) for p in model.experts.r0e0.parameters() for v in optim.state[p].values()}
        return [t.detach().clone() for p in model.parameters() for t in (p, *optim.state[p].values())]

    lazy, ahead = run(False), run(True)
    assert len(lazy) == len(ahead)
    assert all(a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
               for a, b in zip(lazy, ahead))


# ---- fresh optimizers through a restore that fails part of the way -----------------------------

def _rprop(seed):
    model, _ = make_training(seed)
    return model, torch.optim.Rprop(model.parameters(), lr=1e-2)


def _node_checkpointer(dirs, rank):
    return ss.Checkpointer(dirs["root"], local_root=dirs["local"][rank], node_id=rank, local_every=1,
                           peer_replicas=1, persist_every=100, host_memory_gb=0.02)


def _train_on_two_nodes(rank, world, dirs):
    model, optim = _rprop(0)
    with _node_checkpointer(dirs, rank) as ckpt:
        for step in (1, 2):
            _train(model, optim, step, rank)
            ckpt.save(step, {"model": model, "optim": optim})


def _restore_without_room(rank, world, dirs):
    from statesnap.checkpointer import recovery

    model, optim = _rprop(7)
    if rank == 1:  # the replaced node cannot create its copy of the step (a full disk)
        recovery.LocalRecovery._open_staging = lambda self, step, raw: (None, "no space left (injected)")
    with _node_checkpointer(dirs, rank) as ckpt:
        with pytest.raises(ss.CheckpointError, match="no space left"):
            ckpt.load_latest({"model": model, "optim": optim})
    return {f"{i}.{k}": v.clone() for i, s in enumerate(optim.state.values()) for k, v in s.items()}


def test_a_peer_restore_whose_transfers_fail_leaves_a_fresh_optimizer_fresh(tmp_path):
    """Node 1 was replaced: its ranks fetch step 2's files from node 0 while the load fills the
    state, and the load had made the fresh Rprop's state (unfilled) before the transfers failed.
    That state stayed: the restart that could load nothing held step 2's values on rank 0 and
    uninitialised memory on rank 1 (step sizes of 0.0 and 1.7e-41), not an optimizer without state."""
    dirs = {"root": str(tmp_path / "root"), "local": [str(tmp_path / "node0"), str(tmp_path / "node1")]}
    run_ranks(2, _train_on_two_nodes, dirs)
    shutil.rmtree(dirs["local"][1])
    assert run_ranks(2, _restore_without_room, dirs) == [{}, {}]


def _memory_behind_a_damaged_step(rank, world, root):
    model, optim = _rprop(0)
    state = {"model": model, "optim": optim}
    with ss.Checkpointer(root, keep_last=3, host_memory_gb=0.01) as ckpt:
        for step in (1, 2, 3):
            _train(model, optim, step, rank)
            if step == 2:
                ref = reference(state)
            handle = ckpt.save(step, state)
        handle.wait()
        ckpt.memory.discard(3)  # memory holds step 2, root step 3 (its snapshot went: a copy that failed)
        dist.barrier()
        if rank == 0:
            data = next(os.path.join(root, "step-3", n) for n in sorted(os.listdir(os.path.join(root, "step-3")))
                        if n.endswith(".bin"))
            raw = bytearray(open(data, "rb").read())
            raw[len(raw) // 2] ^= 0x01
            open(data, "wb").write(bytes(raw))
        dist.barrier()
        fresh_model, fresh = _rprop(7)
        stepped = []
        fresh.register_step_pre_hook(lambda *_: stepped.append(1))
        with pytest.warns(RuntimeWarning, match="step 3 could not be restored"):
            assert ckpt.load_latest({"model": fresh_model, "optim": fresh}) == 2
        assert ckpt.loaded_from == "memory"
    assert_state_equals({"model": fresh_model, "optim": fresh}, ref)
    return len(stepped)


def test_a_snapshot_in_memory_restored_after_a_damaged_newer_step_takes_no_optimizer_step(tmp_path):
    """Step 3 on root is tried before the older snapshot in memory: the state made for the
    snapshot was taken from the fresh optimizer for that load, which failed, and the snapshot
    then restored into an optimizer without state, whose load_state_dict (PyTorch's helper)
    took a step at lr 0 to make one: its step hooks ran."""
    assert run_ranks(2, _memory_behind_a_damaged_step, str(tmp_path / "ckpt")) == [0, 0]


class _FailsOnce:
    """A state value whose state_dict raises on one rank at one step (a flaky custom object)."""

    def __init__(self, rank: int, step_fails: int):
        self.rank, self.step_fails, self.step = rank, step_fails, 0

    def state_dict(self):
        if self.rank == 1 and self.step == self.step_fails:
            raise RuntimeError("flaky state_dict on rank 1")
        return {}

    def load_state_dict(self, sd):
        pass


def _out_of_step(rank, world, root):
    """save(2) raises on rank 1 only and the loop goes on: each rank's next snapshot to write
    was paired with the other's by order, and steps 2 and 3 were committed torn (rank 0's
    half of one step, rank 1's of the next), passing verify and restored by load_latest."""
    flaky = _FailsOnce(rank, 2)
    ckpt = ss.Checkpointer(root, host_memory_gb=0.01, commit_timeout_s=20)
    outcomes = []
    for step in range(1, 5):
        flaky.step = step
        state = {"w": ss.Sharded(torch.full((4,), float(step)) + 10 * rank, (8,), (4 * rank,)), "f": flaky}
        try:
            handle = ckpt.save(step, state)
            outcomes.append((step, "saved"))
            if step == 1:
                handle.wait()
        except ss.CheckpointError as exc:
            outcomes.append((step, str(exc)))
        except RuntimeError:
            outcomes.append((step, "raised here"))
    try:
        ckpt.close()
        outcomes.append(("close", "ok"))
    except ss.CheckpointError as exc:
        outcomes.append(("close", type(exc).__name__))
    return outcomes


def test_ranks_out_of_step_after_a_save_raised_on_one_commit_nothing_torn(tmp_path):
    root = tmp_path / "ckpt"
    run_ranks(2, _out_of_step, str(root))
    committed = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    assert committed == ["step-1"]  # every later pairing mixed two steps: refused
    # rank 0's last step found no rank to pair with: its staging directory, opened before it
    # heard of none, is removed too
    assert [p.name for p in root.iterdir() if ".tmp-" in p.name] == []
    for name in committed:
        whole = ss.open(root / name).read("w")
        step = int(name.split("-")[1])
        assert torch.equal(whole, torch.cat([torch.full((4,), float(step)), torch.full((4,), step + 10.0)]))


def _different_paths(rank, world, root):
    try:
        ss.save({"w": ss.Sharded(torch.ones(2) * rank, (4,), (2 * rank,))}, os.path.join(root, f"ck-rank{rank}"),
                timeout_s=60)
    except ss.CheckpointError as exc:
        return str(exc)
    return None


def test_ranks_saving_to_different_paths_are_refused_on_every_rank(tmp_path):
    """Rank 1's SaveInfo named a path nothing was written to, while rank 0's checkpoint held its data."""
    errors = run_ranks(2, _different_paths, str(tmp_path))
    assert all(e is not None and "rank 1 saves to" in e and "give every rank the same path" in e for e in errors)
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]


def _one_rank_bad_url(rank, world, root, op):
    path = os.path.join(root, "ck") if rank == 0 else "nosuchproto://bucket/ck"
    try:
        if op == "save":
            ss.save({"w": torch.ones(2)}, path, timeout_s=300)
        else:
            ss.load({"w": torch.zeros(2)}, path, timeout_s=300)
    except ss.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("op", ["save", "load"])
def test_a_path_one_rank_cannot_use_fails_every_rank_with_its_cause(tmp_path, op):
    """The storage of one rank's path failed there before the ranks' first exchange, so the
    others waited the whole timeout (30 minutes by default) and then reported a lost peer."""
    if op == "load":
        ss.save({"w": torch.ones(2)}, tmp_path / "ck")
    outcomes = run_ranks(2, _one_rank_bad_url, str(tmp_path), op)
    assert all(o is not None and "PeerLost" not in o[0] and "nosuchproto" in o[1] for o in outcomes), outcomes


def _destroyed_before_close(rank, world_size, root):
    from statesnap.checkpointer import pipeline

    flush = pipeline.Flusher._flush

    def late_flush(self, snap):
        if snap.step == 2:
            time.sleep(0.5)  # the program's end comes before step 2's flush begins, on every rank
        return flush(self, snap)
    pipeline.Flusher._flush = late_flush
    model, optim = make_training(seed=1)
    ckpt = ss.Checkpointer(root, commit_timeout_s=60)
    ckpt.save(1, {"model": model, "optim": optim}).wait()
    ckpt.save(2, {"model": model, "optim": optim})
    dist.destroy_process_group()  # a torchrun script's usual last line, before close()
    try:
        ckpt.close()
    except ss.CheckpointError as exc:
        return str(exc)
    return None


def test_process_groups_destroyed_before_close_say_so(tmp_path):
    """``dist.destroy_process_group()`` before ``close()`` destroys the Checkpointer's groups too:
    the commit in flight failed as a bare "Group ... is not registered" ValueError, and close()
    raised one from destroying its groups again, hiding which steps were lost."""
    errors = run_ranks(2, _destroyed_before_close, str(tmp_path / "ck"))
    for error in errors:
        assert error is not None and "the process groups were destroyed (dist.destroy_process_group())" in error
        assert "close() the Checkpointer before destroying them" in error
    kept = os.listdir(tmp_path / "ck")
    assert "step-1" in kept and "step-2" not in kept


def _many_checkpointers(rank, world_size, root):
    from statesnap.engine import dist as engine_dist

    model, optim = make_training(seed=1)
    counts = []
    for i in range(8):
        with ss.Checkpointer(os.path.join(root, str(i)), local_root=os.path.join(root, f"local-{rank}")) as ckpt:
            ckpt.save(1, {"model": model, "optim": optim}).wait()
        counts.append((len(os.listdir("/proc/self/fd")), len(engine_dist._IDENTITIES)))
    return counts


def test_closed_checkpointers_leave_no_groups_behind(tmp_path):
    """``close()`` destroyed its gloo groups, but what the transport had learned of their ranks
    held each group, with its sockets and threads: every Checkpointer made and closed on several
    ranks kept file descriptors until a long job's next one ran out of them."""
    for counts in run_ranks(2, _many_checkpointers, str(tmp_path)):
        assert counts[-1] == counts[1], counts  # (the first one makes what stays: the default group's side group)
