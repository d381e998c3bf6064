"""Shared reads: bytes several ranks need are read once and sent; the result is bit for bit the same."""
import warnings

import torch

import statesnap as ss
from dist_utils import run_ranks
from test_reshard import TRAIN_STEPS, build, full_values, train


def _replicated_and_sharded(rank, world, root):
    """A replicated model (every byte needed by every rank), FSDP2 (only the step counts are
    replicated) and declared blocks two of three ranks share, each loaded with and without
    shared reads; returns what was read from storage and whether the values match."""
    out = {}
    for layout in ("plain", "fsdp"):
        model, optim = build(layout, world, rank)
        train(model, optim, TRAIN_STEPS)
        path = f"{root}/{layout}"
        ss.save({"model": model, "optim": optim}, path)
        expected = full_values(model, optim)
        for shared in (False, True):
            target, target_optim = build(layout, world, rank, seed=99)
            info = ss.load({"model": target, "optim": target_optim}, path, shared_reads=shared)
            values = full_values(target, target_optim)
            out[(layout, shared)] = (info.bytes, all(torch.equal(values[k], v) for k, v in expected.items()))
    block = torch.arange(12.0).reshape(3, 4) + (0 if rank < 2 else 100)
    ss.save({"w": ss.Sharded(block, (6, 4), (0 if rank < 2 else 3, 0))}, f"{root}/declared")
    target = ss.Sharded(torch.zeros(3, 4), (6, 4), (0 if rank < 2 else 3, 0))
    info = ss.load({"w": target}, f"{root}/declared", shared_reads=True)
    out["declared"] = (info.bytes, torch.equal(target.local, block))
    return out


def test_shared_reads_read_each_byte_once_and_load_the_same_values(tmp_path):
    results = run_ranks(3, _replicated_and_sharded, str(tmp_path))
    for key in results[0]:
        assert all(r[key][1] for r in results), key
    stored = sum(e.stored_bytes for e in ss.open(tmp_path / "plain").manifest.tensors.values())
    each_alone = [r[("plain", False)][0] for r in results]
    together = sum(r[("plain", True)][0] for r in results)
    assert min(each_alone) >= stored * 0.99  # every replica read everything
    assert together < stored * 1.05  # with sharing, the three ranks read it once between them
    assert sum(r[("fsdp", True)][0] for r in results) < sum(r[("fsdp", False)][0] for r in results)
    # ranks 0 and 1 hold the same block: one of them reads it; rank 2 reads its own
    assert sorted(r["declared"][0] > 0 for r in results) == [False, True, True]


def _odd_sizes(rank, world, root):
    """Replicated tensors of odd byte sizes and several dtypes: a rank receives them packed in
    one message, most at offsets no multiple of their element size."""
    def state(seed):
        g = torch.Generator().manual_seed(seed)
        return {"a": torch.randint(-128, 127, (11,), dtype=torch.int8, generator=g),
                "b": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
                "c": torch.randn(1, dtype=torch.float64, generator=g),
                "d": torch.randn(3, 5, generator=g).to(torch.bfloat16),
                "e": torch.randn(7, dtype=torch.complex64, generator=g),
                "f": torch.randn(4, 6, dtype=torch.float64, generator=g).t(),  # a strided target
                "g": torch.randint(0, 2, (13,), generator=g).bool()}
    ss.save(state(0), f"{root}/odd")
    target = {k: torch.zeros_like(v) for k, v in state(0).items()}
    target["f"] = torch.zeros(4, 6, dtype=torch.float64).t()
    info = ss.load(target, f"{root}/odd", shared_reads=True)
    return info.bytes, all(torch.equal(_bits(target[k]), _bits(v)) for k, v in state(0).items())


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def test_shared_reads_of_odd_sizes_land_bit_for_bit(tmp_path):
    results = run_ranks(2, _odd_sizes, str(tmp_path))
    assert all(exact for _, exact in results)
    assert all(nbytes > 0 for nbytes, _ in results)  # each rank read some and received the rest


def test_auto_shares_only_for_remote_storage():
    from statesnap.engine.dist import Comm
    from statesnap.engine.shared import should_share

    class TwoRanks(Comm):
        def __init__(self):
            self.active, self.group, self.rank, self.world_size = True, None, 0, 2

    assert not should_share(None, TwoRanks(), backend_is_local=True)
    assert should_share(None, TwoRanks(), backend_is_local=False)
    assert should_share(True, TwoRanks(), backend_is_local=True)
    assert not should_share(True, Comm(), backend_is_local=False)  # one process: nothing to share


def _tied_dtensor_stored_once(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    ss.save({"model": {"emb.weight": distribute_tensor(torch.arange(4.0).view(1, 4), mesh, [Shard(0)])}}, path)
    target = distribute_tensor(torch.zeros(1, 4), mesh, [Shard(0)])  # one row: rank 1's part is empty
    info = ss.load({"model": {"emb.weight": target, "head.weight": target}}, path)
    module = torch.nn.Module()  # the same tie in a module, whose state_dict detaches each name apart
    module.emb, module.head = torch.nn.Embedding(1, 4), torch.nn.Linear(4, 1, bias=False)
    module.emb.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(1, 4), mesh, [Shard(0)]))
    module.head.weight = module.emb.weight
    in_module = ss.load({"model": module}, path)
    # a state-dict hook that gives each name a copy of its own: no rank takes the two for one
    module._register_state_dict_hook(lambda mod, sd, prefix, local: {k: v.clone() for k, v in sd.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        copied = ss.load({"model": module}, path, strict=False)
    return (info.missing, target.full_tensor().tolist(), in_module.missing, module.head.weight.full_tensor().tolist(),
            copied.missing)


def test_a_tied_dtensor_stored_once_loads_on_a_rank_whose_part_is_empty(tmp_path):
    """A rank whose part of the tied weight holds no element could not tell the tie by memory:
    it called the second name missing while the other rank did not, and the strict load failed."""
    values = [[0.0, 1.0, 2.0, 3.0]]
    assert run_ranks(2, _tied_dtensor_stored_once, str(tmp_path / "ck")) == [
        ([], values, [], values, ["model.head.weight"])] * 2
