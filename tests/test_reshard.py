"""Resharding on load: checkpoints saved in one parallel layout load into another, bit for bit.

One module fixture runs the whole matrix, because starting gloo processes dominates the cost:
a single-process save, then worlds of 4, 2, 3 and 2 ranks, each saving the layouts later
stages load and loading the ones earlier stages saved. Every rank returns the *full* values of
its state (``full_tensor()`` for DTensors, all-gathered flat shards for ZeRO), and the tests
compare them with ``torch.equal`` against ``ss.open(path).read(fqn)`` of the source checkpoint,
whose values were in turn compared against the source training state when it was saved.
"""
import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import statesnap as ss
from dist_utils import run_ranks

TRAIN_STEPS = 2  # steps before the save
MORE_STEPS = 3  # steps after the load


class Tiny(nn.Module):
    """Odd sizes on purpose: 13 rows do not divide by 2, 3 or 4; 26 rows split by TP into 13 are
    split unevenly again by FSDP on the 2-D mesh (_StridedShard); 2 rows leave ranks empty."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(11, 26)
        self.down = nn.Linear(26, 13)
        self.head = nn.Linear(13, 2)

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


STAGES = [("up", "down"), ("head",)]  # pipeline stage -> the top-level modules it owns
TP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 11, generator=torch.Generator().manual_seed(1000 + step))


def train(model, optim, steps: int, first: int = 0) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        loss = model(batch(step)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()))
    return losses


def build(layout: str, world: int, rank: int, seed: int = 0):
    """A fresh ``Tiny`` in ``layout``; ``seed`` differs between sources and targets so a load
    that misses an element cannot pass by accident."""
    torch.manual_seed(seed)
    model = Tiny()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for name in ("up", "down", "head"):
            fully_shard(getattr(model, name), mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world,)), TP_PLAN)
    elif layout == "2d":  # FSDP x TP: FSDP shards the TP-local rows again (_StridedShard)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], TP_PLAN)
        for name in ("up", "down", "head"):
            fully_shard(getattr(model, name), mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif layout == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    elif layout != "plain":
        raise ValueError(layout)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def pipeline_stage(rank: int, seed: int = 0, steps: int = TRAIN_STEPS):
    """Stage ``rank`` of a 2-stage pipeline: the full model trained, then the other stage's
    modules deleted, so the stage keeps the global names (torchtitan's way of splitting).
    Returns the stage's model and optimizer, and the values of the whole model it was cut from."""
    full, full_optim = build("plain", 1, rank, seed)
    train(full, full_optim, steps)
    whole = full_values(full, full_optim)
    osd = get_optimizer_state_dict(full, full_optim)
    for name in {n for stage in STAGES for n in stage} - set(STAGES[rank]):
        delattr(full, name)
    mine = {n for n, _ in full.named_parameters()}
    optim = torch.optim.AdamW(full.parameters(), lr=1e-2)
    if steps:
        set_optimizer_state_dict(full, optim, {
            "state": {k: v for k, v in osd["state"].items() if k in mine},
            "param_groups": [dict(g, params=[p for p in g["params"] if p in mine]) for g in osd["param_groups"]]})
    return full, optim, whole


PARAM_SHAPES = [(name, tuple(p.shape)) for name, p in Tiny().named_parameters()]


def zero_state(model, optim, rank: int, world: int) -> dict:
    """ZeRO-1 style: each rank owns a contiguous range of the flat concatenation of all
    parameters, and the same range of each Adam moment; ranges split evenly, the last short."""
    total = sum(torch.Size(s).numel() for _, s in PARAM_SHAPES)
    per = -(-total // world)
    lo, hi = min(rank * per, total), min(rank * per + per, total)
    osd = get_optimizer_state_dict(model, optim)

    def flat(values):
        return torch.cat([v.reshape(-1) for v in values])[lo:hi].clone()

    params = dict(model.named_parameters())
    state = {"model": ss.flat_partition(flat(params[n].detach() for n, _ in PARAM_SHAPES), PARAM_SHAPES, lo),
             "optim": {"state": {}, "param_groups": osd["param_groups"]}}
    for key in ("exp_avg", "exp_avg_sq"):
        names = [(f"{n}.{key}", s) for n, s in PARAM_SHAPES]
        state["optim"]["state"].update(
            ss.flat_partition(flat(osd["state"][n][key] for n, _ in PARAM_SHAPES), names, lo))
    for name, _ in PARAM_SHAPES:  # the step counts are replicated scalars
        state["optim"]["state"][f"{name}.step"] = osd["state"][name]["step"]
    return state


def megatron_state(rank: int, world: int, seed: int) -> dict:
    """A framework doing its own tensor parallelism declares each rank's block with ``Sharded``:
    rows split over 2 ranks, columns over 3 (a 13 x 6 matrix, so the row split is uneven)."""
    full = torch.randn(13, 6, generator=torch.Generator().manual_seed(seed))
    dim = 0 if world == 2 else 1
    step = -(-full.shape[dim] // world)
    local = full.narrow(dim, rank * step, min(step, full.shape[dim] - rank * step)).clone()
    offsets = [0, 0]
    offsets[dim] = rank * step
    return {"mp": {"w": ss.Sharded(local, full.shape, offsets)}}


def full_values(model, optim) -> dict:
    """Every tensor of model and optimizer state as a full tensor, under its checkpoint name."""
    def full(v):
        return (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()

    out = {f"model.{k}": full(v) for k, v in get_model_state_dict(model).items()}
    if optim.state:  # get_optimizer_state_dict would initialise a fresh optimizer's state
        for fqn, st in get_optimizer_state_dict(model, optim)["state"].items():
            out.update({f"optim.state.{fqn}.{k}": full(v) for k, v in st.items()})
    return out


def zero_full_values(state: dict) -> dict:
    """All-gather each rank's flat shards and assemble the full tensors they describe."""
    pieces = {}

    def collect(prefix, node):
        for key, value in node.items():
            if isinstance(value, ss.Sharded):
                pieces[f"{prefix}{key}"] = (value.start[0], value.local.clone(), value.global_shape)
            elif isinstance(value, dict):
                collect(f"{prefix}{key}.", value)
            elif isinstance(value, torch.Tensor):
                pieces[f"{prefix}{key}"] = (0, value.reshape(-1).clone(), tuple(value.shape))

    collect("", state)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    flat, shapes = {}, {}
    for rank_pieces in gathered:
        for fqn, (start, local, shape) in rank_pieces.items():
            shapes[fqn] = shape
            flat.setdefault(fqn, torch.full((max(1, torch.Size(shape).numel()),), float("nan"), dtype=local.dtype))
            flat[fqn][start:start + local.numel()] = local
    return {fqn: values.reshape(shapes[fqn]) for fqn, values in flat.items()}


def local_rows(model, name: str) -> int:
    return model.get_parameter(name).to_local().shape[0]


def save_layout(layout, rank, world, path, fresh=False):
    model, optim = build(layout, world, rank)
    if not fresh:
        train(model, optim, TRAIN_STEPS)
    ss.save({"model": model, "optim": optim}, path)
    return full_values(model, optim)


def load_layout(layout, rank, world, path, more_steps=0):
    model, optim = build(layout, world, rank, seed=99)
    ss.load({"model": model, "optim": optim}, path)
    values = full_values(model, optim)
    losses = train(model, optim, more_steps, TRAIN_STEPS)
    return values, losses, model, optim


# ---- the four distributed stages ---------------------------------------------------------------
def stage_world4(rank, world, d):
    out = {}
    values, losses, model, optim = load_layout("fsdp", rank, world, d["plain"], MORE_STEPS)
    out["1->4"] = values
    out["1->4 losses"] = losses
    values, _, model, optim = load_layout("fsdp", rank, world, d["plain"])
    ss.save({"model": model, "optim": optim}, d["again4"])  # for the round trip back to one process
    values, _, model, optim = load_layout("fsdp", rank, world, d["fresh1"])
    out["fresh 1->4"] = (values, len(optim.state))
    out["save fsdp4"] = save_layout("fsdp", rank, world, d["fsdp4"])
    out["save fsdp4 fresh"] = save_layout("fsdp", rank, world, d["fsdp4_fresh"], fresh=True)
    out["save 2d"] = save_layout("2d", rank, world, d["2d"])
    out["save hsdp"] = save_layout("hsdp", rank, world, d["hsdp"])
    out["1->2d"] = load_layout("2d", rank, world, d["plain"])[0]
    model, _ = build("2d", world, rank)
    out["2d placements"] = [repr(p) for p in model.up.weight.placements]
    ss.save({"w": torch.arange(300_000.0), "rng": ss.PerRank(torch.tensor([rank]))}, d["per_rank4"])
    return out


def stage_world2_first(rank, world, d):
    out = {"fsdp4->tp2": load_layout("tp", rank, world, d["fsdp4"])[0],
           "hsdp->tp2": load_layout("tp", rank, world, d["hsdp"])[0],
           "save tp2": save_layout("tp", rank, world, d["tp2"])}
    model, optim, out["pipe2 whole"] = pipeline_stage(rank)
    ss.save({"model": model, "optim": optim}, d["pipe2"])
    out["save pipe2"] = full_values(model, optim)
    ss.save(megatron_state(rank, world, seed=0), d["megatron2"])
    return out


def stage_world3(rank, world, d):
    out = {}
    values, _, model, _ = load_layout("fsdp", rank, world, d["fsdp4"])
    out["4->3"] = values
    out["4->3 head rows"] = local_rows(model, "head.weight")
    out["tp2->fsdp3"] = load_layout("fsdp", rank, world, d["tp2"])[0]
    out["2d->fsdp3"] = load_layout("fsdp", rank, world, d["2d"])[0]
    values, _, _, optim = load_layout("fsdp", rank, world, d["fsdp4_fresh"])
    out["fresh 4->3"] = (values, len(optim.state))
    model, optim = build("plain", 1, rank)
    train(model, optim, TRAIN_STEPS)
    state = zero_state(model, optim, rank, world)
    ss.save(state, d["zero3"])
    out["save zero3"] = zero_full_values(state)
    out["per-rank"] = per_rank_policies(rank, d["per_rank4"])
    out["save ddp3"] = save_layout("ddp", rank, world, d["ddp3"])
    model, optim = build("plain", 1, rank, seed=99)
    train(model, optim, TRAIN_STEPS)
    state = zero_state(model, optim, rank, world)
    ss.load(state, d["plain"])  # into flat partitions: fills the flat buffers in place
    out["1->zero3"] = zero_full_values(state)
    state = megatron_state(rank, world, seed=99)
    ss.load(state, d["megatron2"])
    out["megatron2->3"] = (state["mp"]["w"].local, state["mp"]["w"].start)
    return out


def per_rank_policies(rank, path) -> dict:
    """Per-rank values saved by 4 ranks, loaded by 3: an error unless a policy is given, raised
    before the tensor beside them is read (it is left as it was)."""
    result = {}
    untouched = torch.zeros(300_000)
    try:
        ss.load({"w": untouched, "rng": ss.PerRank(torch.tensor([-1]))}, path)
        result["error"] = None
    except ss.ReshardError as exc:
        result["error"] = str(exc)
    result["untouched"] = not untouched.any()
    for policy in ("rank0", "skip", lambda values, r, w: values[r + 1]):
        holder = ss.PerRank(torch.tensor([-1]), on_resize=policy)
        ss.load({"w": torch.zeros(300_000), "rng": holder}, path)
        result[policy if isinstance(policy, str) else "callable"] = int(holder.value[0])
    return result


def stage_world2_second(rank, world, d):
    return {"zero3->fsdp2": load_layout("fsdp", rank, world, d["zero3"])[0],
            "ddp3->fsdp2": load_layout("fsdp", rank, world, d["ddp3"])[0],
            "fsdp4->ddp2": load_layout("ddp", rank, world, d["fsdp4"])[0]}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    d = {name: str(root / name) for name in ("plain", "fresh1", "again4", "fsdp4", "fsdp4_fresh", "2d", "hsdp",
                                             "per_rank4", "tp2", "pipe2", "zero3", "megatron2", "ddp3")}
    model, optim = build("plain", 1, 0)
    train(model, optim, TRAIN_STEPS)
    ss.save({"model": model, "optim": optim}, d["plain"])
    source = {"save plain": full_values(model, optim)}
    reference = copy.deepcopy((model, optim))
    source["reference losses"] = train(*reference, MORE_STEPS, TRAIN_STEPS)
    fresh_model, fresh_optim = build("plain", 1, 0)
    ss.save({"model": fresh_model, "optim": fresh_optim}, d["fresh1"])
    results = {"paths": d, **source}
    for world, stage in ((4, stage_world4), (2, stage_world2_first), (3, stage_world3), (2, stage_world2_second)):
        for key, value in _by_rank(run_ranks(world, run_stage, stage.__name__, d)).items():
            results[key] = value
    return results


def run_stage(rank, world, stage_name, d) -> bytes:
    """Run the stage and return its result serialised: tensors sent through a multiprocessing
    queue are shared by file descriptor, which dies with the rank's process."""
    buffer = io.BytesIO()
    torch.save(globals()[stage_name](rank, world, d), buffer)
    return buffer.getvalue()


def _by_rank(per_rank: list[bytes]) -> dict:
    per_rank = [torch.load(io.BytesIO(raw), weights_only=True) for raw in per_rank]
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


def assert_same_as_checkpoint(values: dict, path: str):
    reader = ss.open(path)
    assert sorted(values) == sorted(k for k in reader.keys() if k in reader.manifest.tensors)
    for fqn, value in values.items():
        stored = reader.read(fqn)
        assert stored.dtype == value.dtype and torch.equal(stored, value), fqn


# ---- saves hold exactly the source values ------------------------------------------------------
@pytest.mark.parametrize("case,path", [("save plain", "plain"), ("save fsdp4", "fsdp4"), ("save 2d", "2d"),
                                       ("save hsdp", "hsdp"), ("save tp2", "tp2"), ("save zero3", "zero3"),
                                       ("save ddp3", "ddp3")])
def test_saved_values_equal_the_training_state(matrix, case, path):
    for values in (matrix[case] if isinstance(matrix[case], list) else [matrix[case]]):
        assert_same_as_checkpoint(values, matrix["paths"][path])


def test_pipeline_stages_together_hold_the_whole_model(matrix):
    """Values are compared only with the computation that produced them: each stage with the
    whole model its own process trained before cutting it. The plain model trained in the pytest
    process is another computation (another process, other threads), so it gives the names only."""
    stage0, stage1 = matrix["save pipe2"]
    assert not set(stage0) & set(stage1)
    assert sorted({**stage0, **stage1}) == sorted(matrix["save plain"])
    assert_same_as_checkpoint({**stage0, **stage1}, matrix["paths"]["pipe2"])
    for stage, whole in zip(matrix["save pipe2"], matrix["pipe2 whole"]):
        assert sorted(whole) == sorted(matrix["save plain"])
        for fqn, value in stage.items():
            assert torch.equal(value, whole[fqn]), fqn


def test_two_d_mesh_uses_strided_shard(matrix):
    assert any("_StridedShard" in p for p in matrix["2d placements"][0])


# ---- loads into another layout -----------------------------------------------------------------
@pytest.mark.parametrize("case,source", [
    ("1->4", "plain"), ("1->2d", "plain"), ("4->3", "fsdp4"), ("fsdp4->tp2", "fsdp4"), ("hsdp->tp2", "hsdp"),
    ("tp2->fsdp3", "tp2"), ("2d->fsdp3", "2d"), ("zero3->fsdp2", "zero3"), ("1->zero3", "plain"),
    ("ddp3->fsdp2", "ddp3"), ("fsdp4->ddp2", "fsdp4")])
def test_resharded_load_is_bit_exact(matrix, case, source):
    for values in matrix[case]:
        assert_same_as_checkpoint(values, matrix["paths"][source])


@pytest.mark.parametrize("source", ["fsdp4", "pipe2", "2d", "zero3"])
def test_load_into_one_process(matrix, source):
    model, optim = build("plain", 1, 0, seed=99)
    ss.load({"model": model, "optim": optim}, matrix["paths"][source])
    assert_same_as_checkpoint(full_values(model, optim), matrix["paths"][source])


def test_declared_shards_reshard_from_rows_to_columns(matrix):
    full = ss.open(matrix["paths"]["megatron2"]).read("mp.w")
    assert torch.equal(full, megatron_state(0, 1, seed=0)["mp"]["w"].local)
    for local, (row, col) in matrix["megatron2->3"]:
        assert row == 0 and torch.equal(local, full[:, col:col + 2])


@pytest.mark.parametrize("local, offsets", [(torch.ones(3, 8), (0,)), (torch.ones(3, 8, 2), (0, 0)),
                                            (torch.ones(8), (0, 0))])
def test_a_declared_shard_of_other_dimensions_than_its_tensor_is_refused_by_name(local, offsets, tmp_path):
    """Checked by zip, a local tensor of more dimensions than the global shape passed: its save
    failed with numpy's words, and its load blamed the checkpoint ("stores only 24 of the 48
    elements"), which made load_latest give up good steps as damaged."""
    shape = (6,) if len(offsets) == 1 else (6, 8)
    with pytest.raises(ss.CheckpointError, match=r"a box of \d dimensions needs as many offsets and a local "
                                                 r"tensor of as many dimensions"):
        ss.Sharded(local, shape, offsets)


def test_rank_that_receives_no_rows(matrix):
    assert matrix["4->3 head rows"] == [1, 1, 0]
    values = matrix["4->3"][2]
    assert torch.equal(values["model.head.weight"], ss.open(matrix["paths"]["fsdp4"]).read("model.head.weight"))


@pytest.mark.parametrize("case,source", [("fresh 1->4", "fresh1"), ("fresh 4->3", "fsdp4_fresh")])
def test_optimizer_without_steps_stays_fresh(matrix, case, source):
    for values, optimizer_entries in matrix[case]:
        assert optimizer_entries == 0
        assert_same_as_checkpoint(values, matrix["paths"][source])


def test_per_rank_state_needs_a_policy_to_change_world_size(matrix):
    for rank, result in enumerate(matrix["per-rank"]):
        assert "saved by 4 ranks but is loaded by 3" in result["error"] and result["untouched"]
        assert result["rank0"] == 0 and result["skip"] == -1 and result["callable"] == rank + 1


# ---- training goes on as if nothing happened ---------------------------------------------------
def test_training_continues_after_resharding(matrix):
    reference = matrix["reference losses"]
    for losses in matrix["1->4 losses"]:
        assert torch.allclose(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=0)


def test_round_trip_through_another_layout_continues_exactly(matrix):
    """Through 4 FSDP ranks and back to one process: the same values as the source checkpoint,
    and training continues exactly as from the source (both trained here, in this test, so one
    computation is compared with itself, not with one a fixture ran before other tests)."""
    reader, source = ss.open(matrix["paths"]["again4"]), ss.open(matrix["paths"]["plain"])
    assert sorted(reader.manifest.tensors) == sorted(source.manifest.tensors)
    for fqn in source.manifest.tensors:
        assert torch.equal(reader.read(fqn), source.read(fqn)), fqn
    losses = {}
    for name in ("plain", "again4"):
        model, optim = build("plain", 1, 0, seed=99)
        ss.load({"model": model, "optim": optim}, matrix["paths"][name])
        losses[name] = train(model, optim, MORE_STEPS, TRAIN_STEPS)
    assert losses["again4"] == losses["plain"]
