"""Several real gloo ranks: replicated state is written once, spread over ranks; same-layout load."""
import os

import pytest
import torch
import torch.nn as nn

import statesnap as ss
from dist_utils import run_ranks

_PROBE_AT_IMPORT = os.environ.get("STATESNAP_TEST_PROBE")  # read where the ranks import this module


def _ddp_save_load(rank, world, path):
    torch.manual_seed(0)  # same init on every rank: a replicated (DDP-style) model
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "rng": ss.PerRank(torch.tensor([rank * 10]))}
    info = ss.save(state, path)
    reader = ss.open(path)
    files = set(reader.manifest.files)
    fresh = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    rng = ss.PerRank(torch.tensor([-1]))
    ss.load({"model": fresh, "optim": fresh_opt, "rng": rng}, path)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    same_opt = all(torch.equal(opt.state[p][k], fresh_opt.state[q][k])
                   for p, q in zip(model.parameters(), fresh.parameters()) for k in opt.state[p])
    return info.bytes, len(files), same, same_opt, int(rng.value[0])


@pytest.mark.parametrize("hash_seeds", [None, [11, 12, 13]], ids=["forked", "own string hashes"])
def test_replicated_state_written_once_and_spread(tmp_path, hash_seeds):
    """Also with ranks whose sets of strings iterate in different orders: owners and shares are
    agreed on by every rank whatever its order."""
    path = str(tmp_path / "ckpt")
    results = run_ranks(3, _ddp_save_load, path, hash_seeds=hash_seeds)
    one_copy = 6 * (64 * 64 + 64) * 4 * 3  # params + exp_avg + exp_avg_sq, float32
    total = results[0][0]
    assert one_copy <= total < one_copy * 1.05
    assert results[0][1] == 3  # every replica wrote a share
    sizes = [os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".bin")]
    assert max(sizes) < total * 0.6  # balanced by bytes, not all on rank 0
    for rank, (_, _, same, same_opt, rng) in enumerate(results):
        assert same and same_opt
        assert rng == rank * 10


def _stage_loads(rank, world, path):
    """Pipeline-like: each rank holds its own stage's tensors; only what no rank loads is unexpected."""
    stages = [rank, world] if rank == 0 else [rank]  # stage ``world``: saved, then no rank loads it
    ss.save({f"stage{s}": torch.full((3,), float(s)) for s in stages}, path)
    mine = {f"stage{rank}": torch.zeros(3)}
    try:
        ss.load(mine, path)
        strict_error = None
    except ss.StateMismatchError as exc:
        strict_error = exc.unexpected
    ss.load(mine, path, strict=False)
    return strict_error, torch.equal(mine[f"stage{rank}"], torch.full((3,), float(rank)))


def test_a_strict_load_names_only_what_no_rank_loads(tmp_path):
    """Each rank sends one flag per stored name (Comm.any_of), not its names to every rank."""
    path = str(tmp_path / "c")
    assert run_ranks(3, _stage_loads, path) == [(["stage3"], True)] * 3


def _comm_votes(rank, world):
    from statesnap.engine.dist import BROADCAST_SLOT, Comm, RemoteFailure

    comm = Comm(None, "voting", timeout_s=60)
    # broadcasts from any rank: small objects in one round, larger in two, sizes across the slot's edge
    sent = [(src, b"%d" % src * k) for src, k in [(0, 3), (2, 1 << 20)] +
            [(k % world, k) for k in range(BROADCAST_SLOT - 64, BROADCAST_SLOT + 64, 8)]]
    broadcasts = [comm.broadcast(value if rank == src else None, src=src) == value for src, value in sent]
    flags = comm.any_of([i % world == rank and i < 11 for i in range(13)])
    empty = comm.any_of([])
    small = comm.all_gather(rank)
    mixed = comm.all_gather("x" * 5000 if rank == 2 else (rank, None))  # one rank's does not fit the slot
    comm.agree(None, "a step every rank did")
    try:
        comm.agree(ValueError("disk on fire") if rank == 1 else None, "a step rank 1 failed")
        outcome = None
    except RemoteFailure as exc:
        outcome = ("remote", str(exc))
    except ss.CheckpointError as exc:
        outcome = ("own", str(exc))
    return flags, empty, outcome, small, mixed, broadcasts


def test_flags_are_or_ed_across_ranks_and_one_failure_reaches_every_rank():
    """any_of packs flags into bits (13: not a whole number of bytes); all_gather and broadcast
    serve small objects in one round and larger ones in a second; agree exchanges messages only
    when a rank failed, and then every rank raises, naming the rank and its error."""
    results = run_ranks(3, _comm_votes)
    for rank, (flags, empty, outcome, small, mixed, broadcasts) in enumerate(results):
        assert broadcasts and all(broadcasts)
        assert small == [0, 1, 2] and mixed == [(0, None), (1, None), "x" * 5000]
        assert flags == [True] * 11 + [False] * 2
        assert empty == []
        if rank == 1:
            assert outcome == ("own", "a step rank 1 failed failed on rank 1: disk on fire")
        else:
            assert outcome[0] == "remote" and "rank 1: ValueError: disk on fire" in outcome[1]


def _probe(rank, world):
    return _PROBE_AT_IMPORT, os.environ.get("STATESNAP_TEST_PROBE")


def test_a_rank_imports_its_functions_module_in_the_callers_environment(monkeypatch):
    """Ranks fork from a server that started with the environment of its time; the module of the
    rank's function is imported in the rank, and its module-level code sees the environment the
    caller has now, as a spawned rank's did (it saw the server's before: None here)."""
    run_ranks(1, _probe)  # the server is running from here on, without the variable
    monkeypatch.setenv("STATESNAP_TEST_PROBE", "now")
    assert run_ranks(2, _probe) == [("now", "now")] * 2


def _legacy_fsdp(rank, world, path):
    """FSDP1 given a device mesh saves DTensors, which load anywhere; without one it gives
    ShardedTensors, which raised a bare torch error from deep inside the save; a
    ZeroRedundancyOptimizer's state dict fails but on one rank. Both are refused by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def trained(mesh):
        torch.manual_seed(0)
        model = FullyShardedDataParallel(nn.Sequential(nn.Linear(7, 13), nn.Linear(13, 5)),
                                         device_id=torch.device("cpu"), use_orig_params=True, device_mesh=mesh)
        optim = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 7)).sum().backward()
        optim.step()
        return model, optim

    model, optim = trained(init_device_mesh("cpu", (world,)))
    ss.save({"model": model, "optim": optim}, path)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    refused = []
    model, optim = trained(None)
    zero = ZeroRedundancyOptimizer(nn.Linear(4, 4).parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    for state in ({"model": model}, {"optim": zero}):
        try:
            ss.save(state, f"{path}-refused")
        except ss.CheckpointError as exc:
            refused.append(str(exc))
    return full, refused


def test_legacy_fsdp_with_a_mesh_round_trips_and_what_cannot_is_refused_by_name(tmp_path):
    path = str(tmp_path / "c")
    (full, refused), _ = run_ranks(2, _legacy_fsdp, path)
    plain = nn.Sequential(nn.Linear(7, 13), nn.Linear(13, 5))
    ss.load({"model": plain}, path, partial=True)
    assert all(torch.equal(plain.state_dict()[name], value) for name, value in full.items())
    assert "'model.0.weight' is a ShardedTensor, which FSDP1 gives without a device mesh" in refused[0]
    assert "optim: a ZeroRedundancyOptimizer's state dict is collected on one rank only" in refused[1]
