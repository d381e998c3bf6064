"""Replicas are compared by value: a tensor every rank holds alike is stored once, so per-rank
values and drifted replicas must fail the save instead of being reduced to one rank's copy."""
import os

import pytest
import torch
import torch.nn as nn

import statesnap as ss
from dist_utils import run_ranks
from statesnap.engine.replicas import _ranks, differing_pieces, mismatches, replicas_to_check
from statesnap.engine.save import RankOutput
from statesnap.plan.owners import place_writes, plan_owned, route
from statesnap.state.items import ItemMeta


def _model():
    torch.manual_seed(0)  # the same on every rank: DDP-style replicas
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))


def _error(fn):
    try:
        fn()
    except ss.CheckpointError as exc:
        return str(exc)
    return None


def _listing(path):
    return sorted(os.listdir(path))


def _blocking(rank, world, tmp):
    torch.set_num_threads(1)
    model = _model()
    good = os.path.join(tmp, "good")
    torch.manual_seed(100 + rank)  # each rank its own RNG stream
    rng = torch.get_rng_state()
    ss.save({"model": model, "rng": ss.PerRank(rng)}, good)
    out = {}

    # per-rank state as a plain tensor: refused, on every rank, nothing committed anywhere
    plain = {"model": model, "rng": rng}
    out["rng_new"] = _error(lambda: ss.save(plain, os.path.join(tmp, "bad")))
    out["rng_overwrite"] = _error(lambda: ss.save(plain, good, overwrite=True))
    out["listing"] = _listing(tmp)
    loaded = ss.PerRank(torch.zeros_like(rng))
    fresh = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    ss.load({"model": fresh, "rng": loaded}, good)  # the earlier checkpoint is intact
    out["rng_round_trip"] = torch.equal(loaded.value, rng)
    out["model_round_trip"] = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                  fresh.state_dict().values()))
    out["off"] = _error(lambda: ss.save(plain, os.path.join(tmp, "unchecked"), replica_check_mb=0))

    # drifted replicas
    drifted = _model()
    if rank == 1:
        with torch.no_grad():
            drifted[0].weight[0, 0] += 1e-6
    out["drifted"] = _error(lambda: ss.save({"model": drifted}, os.path.join(tmp, "drifted")))

    # declared replicas: saved once, from one rank, without complaint
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (world,))
    differing = torch.full((4,), float(rank))
    declared = {"stat": ss.Replicated(differing.clone()), "module": ss.Replicated(nn.Linear(2, 2)),
                "dt": DTensor.from_local(differing.clone(), mesh, [Replicate()], run_check=False)}
    out["declared"] = _error(lambda: ss.save(declared, os.path.join(tmp, "declared")))

    # a DDP module's buffers are DDP's to synchronise (from rank 0 at the next forward)
    def unsynced(bn):  # what each rank's forward leaves in unsynchronised BatchNorm statistics
        with torch.no_grad():
            bn[1].running_mean.fill_(rank)
        return bn

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    unsynced(ddp.module)
    out["ddp_buffers"] = _error(lambda: ss.save({"model": ddp}, os.path.join(tmp, "ddp")))
    out["bare_buffers"] = _error(lambda: ss.save({"model": ddp.module}, os.path.join(tmp, "bare")))

    # plain values are stored from rank 0 alone: a per-rank one is refused, a declared one kept
    position = {"epoch": 2, "batch": 10 + rank, "rng": [torch.get_rng_state()[:8]]}
    out["plain"] = _error(lambda: ss.save({"loader": position, "same": {"lr": 0.1}}, os.path.join(tmp, "plain")))
    out["plain_declared"] = _error(lambda: ss.save({"loader": ss.Replicated(position)},
                                                   os.path.join(tmp, "plain_declared")))
    out["plain_per_rank"] = _error(lambda: ss.save({"loader": ss.PerRank(position)}, os.path.join(tmp, "plain_per_rank")))
    out["plain_off"] = _error(lambda: ss.save({"loader": position}, os.path.join(tmp, "plain_off"), replica_check_mb=0))

    # pipeline stages hold different values: each is stored (from the rank holding it), none compared
    stage = {"epoch": 2, f"layer{rank}": {"step": 3 + rank}}
    out["stages"] = _error(lambda: ss.save({"optim": stage}, os.path.join(tmp, "stages")))
    return out


def test_blocking_save_compares_replicas(tmp_path):
    results = run_ranks(2, _blocking, str(tmp_path))
    r0, r1 = results
    for key in ("rng_new", "rng_overwrite", "drifted", "plain"):
        assert r0[key] is not None and r0[key] == r1[key], key  # the same error on every rank
    message = r0["rng_new"]
    assert "1 replicated value(s)" in message and "rng (rank 0 vs rank 1)" in message
    assert "ss.PerRank" in message and "ss.Replicated" in message
    assert "was not committed" in r0["rng_overwrite"]
    assert "model.0.weight (rank 0 vs rank 1)" in r0["drifted"] and "model.0.bias" not in r0["drifted"]
    assert r0["bare_buffers"] is None  # module buffers (BatchNorm statistics) are kept from one rank
    assert "loader.batch (rank 0 vs rank 1)" in r0["plain"] and "loader.epoch" not in r0["plain"]
    assert "loader.rng" not in r0["plain"] and "same.lr" not in r0["plain"]  # equal on both ranks
    assert not (tmp_path / "plain").exists()
    assert r0["plain_declared"] is None and r0["plain_per_rank"] is None and r0["plain_off"] is None
    assert r0["stages"] is None
    stages = ss.open(str(tmp_path / "stages"))
    assert (stages.read("optim.epoch"), stages.read("optim.layer0.step"), stages.read("optim.layer1.step")) == (2, 3, 4)
    assert ss.open(str(tmp_path / "plain_declared")).read("loader.batch") == 10  # rank 0's
    for rank, out in enumerate(results):
        assert out["listing"] == ["good"]  # no checkpoint, no staging left behind
        assert out["rng_round_trip"] and out["model_round_trip"], rank
        assert out["off"] is None and out["declared"] is None and out["ddp_buffers"] is None

    good = ss.open(str(tmp_path / "good"))
    assert good.info("model.0.weight").pieces == 1  # identical replicas: stored once
    assert good.manifest.total_bytes < 2 * (8 * 8 + 8 + 4 * 8 + 4) * 4
    declared = ss.open(str(tmp_path / "declared"))
    for name in ("stat", "dt", "module.weight"):
        assert declared.info(name).pieces == 1, name
    for name in ("stat", "dt"):
        assert declared.read(name).tolist() in ([0.0] * 4, [1.0] * 4)  # one rank's copy
    assert ss.open(str(tmp_path / "ddp")).info("model.1.running_mean").pieces == 1


def _checkpointer(rank, world, root):
    torch.set_num_threads(1)
    model = _model()
    torch.manual_seed(100 + rank)
    rng = torch.get_rng_state()
    ckpt = ss.Checkpointer(root, persist_every=2, host_memory_gb=0.01)
    ckpt.save(1, {"model": model, "rng": rng}).wait()  # memory only: no commit, nothing compared
    ckpt.save(2, {"model": model, "rng": ss.PerRank(rng)}).wait()
    handle = ckpt.save(4, {"model": model, "rng": rng})
    at_wait = _error(handle.wait)
    ckpt.save(6, {"model": model, "stat": ss.Replicated(torch.tensor([rank]))}).wait()
    ckpt.close()  # the failure was raised by wait(): not again

    again = ss.Checkpointer(root, persist_every=2, host_memory_gb=0.01)
    again.save(8, {"model": model, "rng": rng})
    at_close = _error(again.close)
    steps = sorted(n for n in os.listdir(root) if n.startswith("step-"))
    loaded = ss.PerRank(torch.zeros_like(rng))
    ss.load({"rng": loaded}, os.path.join(root, "step-2"), strict=False)
    return at_wait, at_close, steps, torch.equal(loaded.value, rng)


def test_checkpointer_compares_replicas_at_commit(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(2, _checkpointer, root)
    for at_wait, at_close, steps, rng_ok in results:
        assert at_wait is not None and "step-4" in at_wait and "rng (rank 0 vs rank 1)" in at_wait
        assert at_close is not None and "step-8" in at_close and "ss.PerRank" in at_close
        assert steps == ["step-2", "step-6"] and rng_ok
    assert results[0][:2] == results[1][:2]
    assert ss.open(os.path.join(root, "step-6")).info("stat").pieces == 1


def _meta(fqn, start, size, nbytes=16):
    return ItemMeta(fqn, "float32", (4, 4), "box", start, size, nbytes)


def test_replicas_to_check_finds_the_writer_of_each_replica():
    """HSDP-like: two row blocks of ``w``, each held by two ranks; ``b`` on all four; ``big``
    over the limit, sampled. Every rank hashes the pieces it holds but does not write, naming the
    writer, from what the tensor owners told it (plan/owners.py, run here for the four ranks at once)."""
    metas = [[_meta("w", (2 * (r // 2), 0), (2, 4)), _meta("b", (0, 0), (4, 4)),
              _meta("big", (0, 0), (4, 4), nbytes=1 << 30)] for r in range(4)]
    inboxes = {}
    for rank in range(4):
        for owner, sent in route(metas[rank], (), 4).items():
            inboxes.setdefault(owner, {})[rank] = sent
    owned = [plan_owned(inbox) for inbox in inboxes.values()]
    placed = [place_writes(metas[r], [o.decisions[r] for o in owned if r in o.decisions], r) for r in range(4)]
    writes = [{index for index, _ in writes} for writes, _, _ in placed]
    for rank, (_, _, elsewhere) in enumerate(placed):
        found = replicas_to_check(elsewhere, metas[rank], [False] * 3, 1 << 20)
        assert {index for index, *_ in found} == {0, 1, 2} - writes[rank]
        for index, fqn, writer, item, sampled in found:
            assert writer != rank and item in writes[writer] and fqn == metas[rank][index].fqn
            assert metas[writer][item] == metas[rank][index] and sampled == (fqn == "big")
        assert replicas_to_check(elsewhere, metas[rank], [True] * 3, 1 << 20) == []
        assert replicas_to_check(elsewhere, metas[rank], [False] * 3, 0) == []
    assert sum(len(w) for w in writes) == 2 + 1 + 1  # each distinct piece written once


def test_mismatch_names_each_tensor_with_the_ranks_that_agree():
    """The owner of ``rng`` and ``ok`` got rank 0's checksums of them and the other ranks' hashes."""
    written = {0: [1], 1: [3]}  # rank 0's item index -> block checksums
    same = ("ok", 0, 1, [3], False)
    hashes = [(1, ("rng", 0, 0, [2], False)), (1, same), (2, ("rng", 0, 0, [1], False)), (2, same),
              (3, ("rng", 0, 0, [2], False)), (3, same)]
    pieces = differing_pieces(lambda writer, item, sampled: written[item], hashes)
    assert pieces == {"rng": ["ranks 0, 2 vs ranks 1, 3"]}
    outputs = [RankOutput(None, 0, {}, {}, set()) for _ in range(4)]
    message = mismatches(outputs, pieces)
    assert message.startswith("1 replicated value(s)") and "rng (ranks 0, 2 vs ranks 1, 3)" in message
    assert "ok (" not in message
    assert differing_pieces(lambda writer, item, sampled: written[item], [(1, same)]) == {}
    # a sample the writer took none of (another limit on its side) is compared with nothing
    assert differing_pieces(lambda writer, item, sampled: None, [(1, ("big", 0, 0, [5], True))]) == {}
    assert mismatches(outputs, {}) is None


@pytest.mark.parametrize("ranks, text", [([3], "rank 3"), ([0, 1, 2, 5], "ranks 0-2, 5"),
                                         ([0, 2, 3, 4, 1023], "ranks 0, 2-4, 1023")])
def test_rank_lists_stay_short(ranks, text):
    assert _ranks(ranks) == text


def test_replicated_refuses_per_rank_values():
    with pytest.raises(ss.CheckpointError, match="either per rank or replicated"):
        ss.Replicated(ss.PerRank(torch.zeros(1)))
    with pytest.raises(ss.CheckpointError):
        ss.Replicated(ss.Replicated(3))


def test_a_missing_report_fails_the_commit_unless_a_writer_failed():
    """An owner that got no report of a written piece must not build a manifest without it: that
    fails the commit, except where a writer failed (which explains the gap and says why)."""
    from statesnap.engine.save import OwnerReport, report_errors

    missing = OwnerReport(None, None, None, {}, "a tensor owner got no report of an item (3)")
    fine = OwnerReport(None, None, {}, {})
    assert report_errors([fine, missing]) == [None, "a tensor owner got no report of an item (3)"]
    failed = OwnerReport(None, "OSError: disk full", None, {})
    assert report_errors([failed, missing, fine]) == ["OSError: disk full", None, None]


def _large(rank, world, tmp):
    torch.set_num_threads(1)
    same = torch.arange(600_000, dtype=torch.float32)  # 2.3 MiB, over the 1 MiB compared whole
    torch.manual_seed(100 + rank)
    own = torch.randn(600_000)  # each rank's own values, as a per-rank buffer holds
    second_block = same.clone()
    if rank == 1:
        second_block[(1 << 20) // 4] += 1  # the first element of the second 1 MiB block
    out = {}
    for name, state in (("same", {"w": same}), ("own", {"w": same, "buf": own}),
                        ("declared", {"w": same, "buf": ss.Replicated(own)}), ("second", {"w": second_block})):
        out[name] = _error(lambda: ss.save(state, os.path.join(tmp, name), block_bytes=1 << 20))
    ckpt = ss.Checkpointer(os.path.join(tmp, "root"), host_memory_gb=0.1, block_bytes=1 << 20)
    out["ckpt_same"] = _error(ckpt.save(1, {"w": same, "buf": ss.Replicated(own)}).wait)
    out["ckpt_own"] = _error(ckpt.save(2, {"w": same, "buf": own}).wait)
    ckpt.close()
    out["steps"] = sorted(n for n in os.listdir(os.path.join(tmp, "root")) if n.startswith("step-"))
    return out


def test_large_replicas_are_compared_by_a_sample_of_each_block(tmp_path):
    """A per-rank tensor over ``replica_check_mb`` that is not wrapped in ``ss.PerRank`` was
    stored from one rank and the other ranks' values lost without a word: it is now compared by
    the first 4 KiB of each checksum block, in a blocking save and at a Checkpointer's commit."""
    r0, r1 = run_ranks(2, _large, str(tmp_path))
    for key in ("same", "declared", "ckpt_same"):
        assert r0[key] is None and r1[key] is None, key
    for key in ("own", "second", "ckpt_own"):
        assert r0[key] is not None and r0[key] == r1[key], key
    assert "buf (rank 0 vs rank 1)" in r0["own"] and "w (" not in r0["own"] and "ss.PerRank" in r0["own"]
    assert "w (rank 0 vs rank 1)" in r0["second"]
    assert "buf (rank 0 vs rank 1)" in r0["ckpt_own"] and r0["steps"] == ["step-1"]
    assert not (tmp_path / "own").exists() and not (tmp_path / "second").exists()
    assert torch.equal(ss.open(str(tmp_path / "same")).read("w"), torch.arange(600_000, dtype=torch.float32))


def _uneven(rank, world, tmp, check_mb):
    torch.set_num_threads(1)
    state = {"w": torch.arange(2 << 20, dtype=torch.float32)}  # 8 MiB on both ranks
    if rank == 1:  # a larger state of its own: its arena, and the blocks it allowed, were larger
        state["mine"] = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB
    ckpt = ss.Checkpointer(os.path.join(tmp, "root"), host_memory_gb=1, replica_check_mb=check_mb)
    error = _error(ckpt.save(1, state).wait)
    ckpt.close()
    return error


@pytest.mark.parametrize("check_mb", [0, 1])
def test_ranks_of_uneven_states_checksum_in_blocks_of_one_size(tmp_path, check_mb):
    """Each rank sized its checksum blocks by its own arena, the manifest recorded rank 0's: the
    step committed and every read of the larger rank's tensor failed ('the wrong number of
    checksums'), and identical large replicas, sampled by blocks of two sizes, were called
    different."""
    assert run_ranks(2, _uneven, str(tmp_path), check_mb) == [None, None]
    reader = ss.open(str(tmp_path / "root" / "step-1"))
    assert torch.equal(reader.read("w"), torch.arange(2 << 20, dtype=torch.float32))
    assert torch.equal(reader.read("mine"), torch.arange(16 << 20, dtype=torch.float32))
    assert reader.verify()


def _one_rank_holds_little(rank, world, tmp):
    torch.set_num_threads(1)
    state = {"w": torch.arange(10 << 20, dtype=torch.float32)} if rank == 0 else {"tiny": torch.ones(3), "n": 1}
    ckpt = ss.Checkpointer(os.path.join(tmp, "root"), host_memory_gb=1)
    error = _error(ckpt.save(1, state).wait)
    ckpt.close()
    return error


def test_a_rank_holding_little_leaves_the_blocks_their_size(tmp_path):
    """A rank whose items each fit one staging segment needs no smaller blocks: agreeing on the
    smallest block any arena allows made a rank holding a few bytes shrink every rank's blocks to
    a page, and the manifest of 40 MiB to 10,000 checksums."""
    assert run_ranks(2, _one_rank_holds_little, str(tmp_path)) == [None, None]
    reader = ss.open(str(tmp_path / "root" / "step-1"))
    assert reader.manifest.block_bytes == 16 << 20 and reader.verify()
    assert torch.equal(reader.read("w"), torch.arange(10 << 20, dtype=torch.float32))
