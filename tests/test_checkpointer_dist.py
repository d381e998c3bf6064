"""The Checkpointer on two real gloo ranks: DDP-style replicas, sharded and per-rank state,
gradient all-reduces on the trainer's group while commits run on the Checkpointer's own group."""
import os

import torch
import torch.distributed as dist

import statesnap as ss
from dist_utils import run_ranks
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


def test_two_ranks_save_commit_and_restore(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(2, _save_and_restore, root)
    for rank, (step, files, rank_value, _) in enumerate(results):
        assert step == 4
        assert files == 2  # both ranks wrote a share of the replicated model
        assert rank_value == rank
    expected = torch.cat([torch.arange(8.0) + 4, torch.arange(8.0) + 104])
    assert torch.equal(results[0][3], expected)
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-2", "step-4"]
