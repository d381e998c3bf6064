"""A fresh optimizer's state, made for a load from what the checkpoint holds, without a step.

PyTorch's state-dict helper makes a fresh optimizer's state with a step at lr 0, which runs
the optimizer's own code (a subclass's extra work) and is skipped when a parameter holds a
gradient: a load after a backward pass then found nothing to fill and failed as a mismatch.
"""
from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

import statesnap as ss
from statesnap.state.optim_state import _STATE_KEYS, _state_keys_of
from dist_utils import run_ranks

KINDS = {  # every optimizer of PyTorch's whose state the load makes, with the options that change it
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
    "AdamW amsgrad": (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True}),
    "SGD momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01}),
    "RMSprop momentum centered": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 0.5}),
    "Adamax": (torch.optim.Adamax, {"lr": 0.01}),
    "NAdam": (torch.optim.NAdam, {"lr": 0.01}),
    "RAdam": (torch.optim.RAdam, {"lr": 0.01}),
    "Rprop": (torch.optim.Rprop, {"lr": 0.01}),
    "ASGD": (torch.optim.ASGD, {"lr": 0.01}),
    "Adafactor": (torch.optim.Adafactor, {"lr": 0.01}),
}


def model_of(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # a 3 x 16 weight: its state is tensors in data files; a 3-element bias: stored inline
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3))


def step(model, optim, seed: int) -> None:
    optim.zero_grad()
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))).square().sum().backward()
    optim.step()


def trained(kind: str, seed: int = 0, steps: int = 2):
    cls, options = KINDS[kind]
    model = model_of(seed)
    optim = cls(model.parameters(), **options)
    for s in range(steps):
        step(model, optim, s)
    return model, optim


def assert_same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    pa = [p for g in a.param_groups for p in g["params"]]
    pb = [p for g in b.param_groups for p in g["params"]]
    for p, q in zip(pa, pb, strict=True):
        assert set(a.state[p]) == set(b.state[q])
        for key, value in a.state[p].items():
            other = b.state[q][key]
            assert (other.dtype, other.shape, other.device) == (value.dtype, value.shape, value.device), key
            assert torch.equal(other, value), key


def assert_trains_on_alike(model, optim, other_model, other) -> None:
    """Two more steps of each on the same batches give the same parameters and state."""
    for seed in (10, 11):
        step(model, optim, seed)
        step(other_model, other, seed)
    for p, q in zip(model.parameters(), other_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert_same_state(optim, other)


def test_the_state_keys_are_those_a_real_step_makes():
    """The table the load makes state by, against what each optimizer's own step makes (a new
    PyTorch that keeps other keys fails here; the load itself would take the step then)."""
    covered = set()
    for kind, (cls, options) in KINDS.items():
        model, optim = trained(kind, steps=1)
        keys_of = _state_keys_of(optim)
        covered |= {c.__name__ for c in cls.__mro__}
        for group in optim.param_groups:
            for p in group["params"]:
                assert set(optim.state[p]) == keys_of(group, p), (kind, tuple(p.shape))
    embedding = nn.Embedding(10, 4, sparse=True)  # SparseAdam takes sparse gradients only
    sparse = torch.optim.SparseAdam(embedding.parameters())
    embedding(torch.tensor([1, 3])).sum().backward()
    sparse.step()
    assert set(sparse.state[embedding.weight]) == _state_keys_of(sparse)(sparse.param_groups[0], embedding.weight)
    model = model_of(0)  # LBFGS: its state under its first parameter, its history once it has one
    lbfgs = torch.optim.LBFGS(model.parameters(), history_size=3)

    def closure():
        lbfgs.zero_grad()
        loss = model(torch.ones(2, 16)).square().sum()
        loss.backward()
        return loss
    lbfgs.step(closure)
    first, *others = model.parameters()
    required, allowed = _state_keys_of(lbfgs)(lbfgs.param_groups[0], first)
    assert required < set(lbfgs.state[first]) == allowed and not any(lbfgs.state[p] for p in others)
    assert set(_STATE_KEYS) <= covered | {"SparseAdam", "LBFGS"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("grads", [False, True], ids=["no grads", "grads present"])
def test_a_fresh_optimizer_loads_without_a_step_and_steps_on_exactly(tmp_path, kind, grads):
    model, optim = trained(kind)
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    fresh_model = model_of(7)
    cls, options = KINDS[kind]
    fresh = cls(fresh_model.parameters(), **options)
    steps = []
    fresh.register_step_pre_hook(lambda *_: steps.append(1))
    handle = register_optimizer_step_pre_hook(lambda *_: steps.append(2))
    try:
        if grads:  # a load after a backward pass: PyTorch's helper made no state then
            fresh_model(torch.ones(2, 16)).sum().backward()
        held = [None if p.grad is None else p.grad.clone() for p in fresh_model.parameters()]
        ss.load({"model": fresh_model, "optim": fresh}, tmp_path / "c")
        assert steps == []  # no step of any kind, not even one unseen by the instance's hooks
    finally:
        handle.remove()
    for p, grad in zip(fresh_model.parameters(), held):
        assert (p.grad is None) == (grad is None) and (grad is None or torch.equal(p.grad, grad))
    assert_same_state(optim, fresh)
    assert fresh.param_groups[0]["lr"] == options["lr"]
    assert_trains_on_alike(model, optim, fresh_model, fresh)


class _EmaSGD(torch.optim.SGD):
    """An SGD with momentum that also updates an EMA in its step."""

    def __init__(self, params, extra_state: bool = False):
        super().__init__(params, lr=0.1, momentum=0.9)
        self.calls, self.extra_state = 0, extra_state

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        super().step(closure)
        if self.extra_state:  # state of its own beside SGD's
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["ema"] = self.state[p].get("ema", torch.zeros_like(p)).mul_(0.5).add_(p)


@pytest.mark.parametrize("extra_state", [False, True], ids=["sgd's state", "its own state too"])
def test_a_subclass_loads_without_its_step_unless_it_keeps_state_of_its_own(tmp_path, extra_state):
    """A subclass of one of PyTorch's optimizers keeping that optimizer's state loads without a
    step (its extra work ran once per load before). One that keeps keys of its own is made
    state by a step as before, with its gradients set aside and put back."""
    model = model_of(0)
    optim = _EmaSGD(model.parameters(), extra_state)
    for s in range(2):
        step(model, optim, s)
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    fresh_model = model_of(7)
    fresh = _EmaSGD(fresh_model.parameters(), extra_state)
    fresh_model(torch.ones(2, 16)).sum().backward()
    grads = [p.grad.clone() for p in fresh_model.parameters()]
    ss.load({"model": fresh_model, "optim": fresh}, tmp_path / "c")
    assert fresh.calls == (1 if extra_state else 0)
    assert all(torch.equal(p.grad, g) for p, g in zip(fresh_model.parameters(), grads))
    assert_same_state(optim, fresh)


@pytest.mark.parametrize("kind", ["AdamW amsgrad", "RMSprop", "SGD momentum"])
def test_a_parameter_no_gradient_reached_resumes_without_state(tmp_path, kind):
    """A parameter the saved run never gave a gradient (an unused branch, an expert no token
    reached) has no optimizer state in the checkpoint. A fresh optimizer got state for every
    parameter (Adam's made ahead, others by the step), so the checkpoint lacked some and a
    strict load failed: a resume was impossible without ``strict=False``. It now gets state
    for exactly what the checkpoint holds, as the run that saved it had."""
    model, optim = trained(kind)
    unused = nn.Linear(3, 3)
    cls, options = KINDS[kind]
    both = nn.ModuleDict({"net": model, "unused": unused})
    optim = cls(both.parameters(), **options)
    for s in range(2):
        step(model, optim, s)
    assert unused.weight not in optim.state
    ss.save({"model": both, "optim": optim}, tmp_path / "c")
    fresh_model, fresh_unused = model_of(7), nn.Linear(3, 3)
    fresh_both = nn.ModuleDict({"net": fresh_model, "unused": fresh_unused})
    fresh = cls(fresh_both.parameters(), **options)
    ss.load({"model": fresh_both, "optim": fresh}, tmp_path / "c")
    assert fresh_unused.weight not in fresh.state and fresh_unused.bias not in fresh.state
    assert_same_state(optim, fresh)
    step(model, optim, 5)
    step(fresh_model, fresh, 5)
    assert all(torch.equal(p, q) for p, q in zip(both.parameters(), fresh_both.parameters()))


@pytest.mark.parametrize("kind", ["SGD momentum", "RMSprop momentum centered"])
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "trained"])
def test_a_layer_the_saved_run_did_not_use_loads_and_steps_on_exactly(tmp_path, kind, fresh):
    """A parameter that had no gradient in the saved run (a layer it did not use) has no state,
    in the checkpoint and in an optimizer trained alike. PyTorch's set_optimizer_state_dict
    refused such a state dict after the load had read everything ("Missing optimizer state for
    parameter '3.weight' ... use StateDictOptions(strict=False)", an option ss.load has not):
    no optimizer of such a model could be loaded, with strict=False neither."""
    cls, options = KINDS[kind]

    def unused_layer(seed: int):
        model = model_of(seed)
        model.append(nn.Linear(3, 3))  # never called by step(): no gradient, no state
        model.forward = lambda x: model[2](model[1](model[0](x)))
        return model, cls(model.parameters(), **options)

    model, optim = unused_layer(0)
    for s in range(2):
        step(model, optim, s)
    assert model[3].weight not in optim.state
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    fresh_model, loaded = unused_layer(7)
    if not fresh:
        for s in range(2):
            step(fresh_model, loaded, 20 + s)
    ss.load({"model": fresh_model, "optim": loaded}, tmp_path / "c")
    assert_same_state(optim, loaded)
    assert_trains_on_alike(model, optim, fresh_model, loaded)


class _OffloadedSGD(_EmaSGD):
    """An SGD whose state dict holds its state on the CPU, as a subclass or a state-dict hook
    may make it (each value of the state mapped)."""

    def state_dict(self):
        sd = super().state_dict()
        sd["state"] = {k: {key: value.cpu() for key, value in s.items()} for k, s in sd["state"].items()}
        return sd


def test_a_state_dict_that_maps_the_state_saves_and_loads_a_fresh_optimizer(tmp_path):
    """The state that tells PyTorch's helper the optimizer has state (so that it takes no step)
    marked each parameter with a plain int, which an optimizer's state_dict mapping each value
    of the state refused: a save of it before its first step failed ("'int' object has no
    attribute 'cpu'"), and so did a load into it fresh."""
    model = model_of(0)
    optim = _OffloadedSGD(model.parameters())
    ss.save({"model": model, "optim": optim}, tmp_path / "before")
    assert not optim.state and optim.calls == 0
    for s in range(2):
        step(model, optim, s)
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    fresh_model = model_of(7)
    fresh = _OffloadedSGD(fresh_model.parameters())
    ss.load({"model": fresh_model, "optim": fresh}, tmp_path / "c")
    assert fresh.calls == 0
    assert_same_state(optim, fresh)


def test_state_of_another_kind_is_still_a_mismatch(tmp_path):
    """Adam's state is not made for an SGD: the load refuses it by name as before."""
    model = model_of(0)
    optim = torch.optim.Adam(model.parameters())
    step(model, optim, 0)
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    fresh_model = model_of(7)
    fresh = torch.optim.SGD(fresh_model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ss.StateMismatchError, match="optim.state.0.weight.exp_avg"):
        ss.load({"model": fresh_model, "optim": fresh}, tmp_path / "c")
    assert not fresh.state


def test_state_of_another_dtype_needs_cast_as_for_an_optimizer_with_state(tmp_path):
    """Float32 state into a fresh optimizer of bfloat16 parameters: the state was made in the
    stored dtype, so the load took it silently and the optimizer's own load_state_dict cast it,
    where an optimizer that has state is refused without cast=True."""
    params = [nn.Parameter(torch.randn(40, 40))]
    optim = torch.optim.RMSprop(params, lr=0.01, momentum=0.9)
    params[0].square().sum().backward()
    optim.step()
    ss.save({"optim": optim}, tmp_path / "c")
    half = [nn.Parameter(torch.randn(40, 40, dtype=torch.bfloat16))]
    fresh = torch.optim.RMSprop(half, lr=0.01, momentum=0.9)
    with pytest.raises(ss.StateMismatchError, match=r"optim.state.0.square_avg \(checkpoint float32\[40, 40\], "
                                                    r"target bfloat16"):
        ss.load({"optim": fresh}, tmp_path / "c")
    assert not fresh.state
    ss.load({"optim": fresh}, tmp_path / "c", cast=True)
    for key in ("square_avg", "momentum_buffer"):
        assert torch.equal(fresh.state[half[0]][key], optim.state[params[0]][key].to(torch.bfloat16)), key


def test_a_failed_load_leaves_the_made_state_behind_no_more(tmp_path):
    """A load that fails after making a fresh optimizer's state takes it away again."""
    model, optim = trained("RMSprop momentum centered")
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    reader = ss.open(tmp_path / "c")
    entry = reader.manifest.tensors["optim.state.0.weight.grad_avg"]
    data = tmp_path / "c" / reader.manifest.files[int(entry.file[0])]
    raw = bytearray(data.read_bytes())
    raw[int(entry.offset[0])] ^= 0x10
    data.write_bytes(bytes(raw))
    fresh_model = model_of(7)
    fresh = torch.optim.RMSprop(fresh_model.parameters(), lr=0.01, momentum=0.5, centered=True)
    with pytest.raises(ss.CorruptCheckpointError, match="optim.state.0.weight.grad_avg"):
        ss.load({"model": fresh_model, "optim": fresh}, tmp_path / "c")
    assert not fresh.state


def test_an_optimizer_over_parameters_in_a_list_of_the_state_keys_them_by_their_names_there(tmp_path):
    params = [nn.Parameter(torch.randn(3, 40)), nn.Parameter(torch.randn(5))]
    optim = torch.optim.NAdam(params, lr=0.01)
    for s in range(2):
        optim.zero_grad()
        sum((p * s).square().sum() for p in params).backward()
        optim.step()
    ss.save({"optim": optim, "params": params}, tmp_path / "c")
    assert "optim.state.params.1.exp_avg" in ss.open(tmp_path / "c").keys()
    fresh_params = [nn.Parameter(torch.zeros(3, 40)), nn.Parameter(torch.zeros(5))]
    fresh = torch.optim.NAdam(fresh_params, lr=0.01)
    ss.load({"optim": fresh, "params": fresh_params}, tmp_path / "c")
    assert_same_state(optim, fresh)


def test_a_restore_from_memory_makes_the_state_without_a_step(tmp_path):
    model = model_of(0)
    optim = _EmaSGD(model.parameters())
    step(model, optim, 0)
    with ss.Checkpointer(tmp_path / "root", persist_every=1) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
        ckpt.wait_staged()
        fresh_model = model_of(7)
        fresh = _EmaSGD(fresh_model.parameters())
        assert ckpt.load_latest({"model": fresh_model, "optim": fresh}) == 1 and ckpt.loaded_from == "memory"
    assert fresh.calls == 0
    assert_same_state(optim, fresh)


@pytest.mark.parametrize("persisted", [False, True], ids=["in memory only", "persisted too"])
def test_a_restore_from_memory_takes_state_whose_keys_the_step_makes_in_another_order(tmp_path, persisted):
    """The state made from the snapshot's names holds each parameter's keys in their sorted
    order, RMSprop's own step in its own (step, square_avg, momentum_buffer, grad_avg): the
    snapshot was taken for another layout, load_latest skipped it, and returned None where
    nothing was persisted (a restart from scratch) or took the persisted step."""
    model, optim = trained("RMSprop momentum centered")
    with ss.Checkpointer(tmp_path / "root", persist_every=1 if persisted else 1000) as ckpt:
        ckpt.save(2, {"model": model, "optim": optim}).wait()
        fresh_model = model_of(7)
        fresh = torch.optim.RMSprop(fresh_model.parameters(), **KINDS["RMSprop momentum centered"][1])
        assert ckpt.load_latest({"model": fresh_model, "optim": fresh}) == 2 and ckpt.loaded_from == "memory"
    assert_same_state(optim, fresh)
    assert_trains_on_alike(model, optim, fresh_model, fresh)


@contextlib.contextmanager
def _rprop_in_memory(tmp_path):
    """A Checkpointer holding step 1 of a trained Rprop in host memory only."""
    model = model_of(0)
    optim = torch.optim.Rprop(model.parameters(), lr=0.01)
    step(model, optim, 0)
    with ss.Checkpointer(tmp_path / "root", persist_every=1000) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
        ckpt.wait_staged()
        yield ckpt


def test_a_snapshot_in_memory_of_another_layout_leaves_a_fresh_optimizer_fresh(tmp_path):
    """load_latest flattens the state against the newest snapshot in host memory to see whether
    the snapshot fits it, which makes a fresh optimizer's state. A model of another layout (a
    buffer more) does not fit: load_latest refuses it (it once returned None), and had left the
    optimizer with state made of zeros: an Rprop whose step sizes were zero, not the learning
    rate its first step starts from."""
    with _rprop_in_memory(tmp_path) as ckpt:
        other = model_of(7)
        other.register_buffer("extra", torch.zeros(2))
        fresh = torch.optim.Rprop(other.parameters(), lr=0.01)
        with pytest.raises(ss.StateMismatchError, match=r"missing in checkpoint \(1\): model.extra"):
            ckpt.load_latest({"model": other, "optim": fresh})
    assert not fresh.state


@pytest.mark.parametrize("unused", ["snapshot gone", "restore failed"])
def test_a_snapshot_in_memory_that_does_not_restore_leaves_a_fresh_optimizer_fresh(tmp_path, monkeypatch, unused):
    """The snapshot in host memory fits the state, so matching it made a fresh optimizer's
    state; but it was not what restored it: it went before it could be read (or another rank
    held another step), or its restore failed. With nothing persisted, load_latest returned None
    (or raised) and left the optimizer with state made of zeros: an Rprop whose step sizes were
    zero, so that its parameters never moved again."""
    from statesnap.checkpointer import restore, staging

    with _rprop_in_memory(tmp_path) as ckpt:
        other = model_of(7)
        fresh = torch.optim.Rprop(other.parameters(), lr=0.01)
        state = {"model": other, "optim": fresh}
        if unused == "snapshot gone":
            monkeypatch.setattr(staging.Arena, "borrow", lambda self, region: False)
            assert ckpt.load_latest(state) is None
        else:
            monkeypatch.setattr(restore, "restore_from_memory", lambda *args: 1 / 0)
            with pytest.raises(ss.CheckpointError):
                ckpt.load_latest(state)
        monkeypatch.undo()
    assert not fresh.state


# ---- FSDP2: state made as DTensors, on 2 gloo ranks ---------------------------------------------
def _fsdp(seed: int):
    model = model_of(seed)
    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_save_and_load(rank, world, path) -> bytes:
    model = _fsdp(0)
    optim = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.5, centered=True)
    for s in range(2):
        step(model, optim, s)
    ss.save({"model": model, "optim": optim}, path)
    fresh_model = _fsdp(7)
    fresh = torch.optim.RMSprop(fresh_model.parameters(), lr=0.01, momentum=0.5, centered=True)
    fresh_model(torch.ones(2, 16)).sum().backward()  # grads present
    steps = []
    handle = register_optimizer_step_pre_hook(lambda *_: steps.append(1))
    try:
        ss.load({"model": fresh_model, "optim": fresh}, path)
    finally:
        handle.remove()
    placements = sorted({str(v.placements) for s in fresh.state.values() for v in s.values()
                         if isinstance(v, DTensor)})
    full = get_optimizer_state_dict(fresh_model, fresh, options=StateDictOptions(full_state_dict=True))["state"]
    buffer = io.BytesIO()
    torch.save({"placements": placements, "steps": len(steps),
                "state": {f"optim.state.{n}.{k}": v for n, s in full.items() for k, v in s.items()}}, buffer)
    return buffer.getvalue()


def test_fsdp2_state_is_made_sharded_like_its_parameters(tmp_path):
    path = str(tmp_path / "c")
    results = [torch.load(io.BytesIO(raw), weights_only=True) for raw in run_ranks(2, _fsdp_save_and_load, path)]
    reader = ss.open(path)
    stored = [k for k in reader.keys() if k.startswith("optim.state.")]
    for result in results:
        # made without a step: the stored step (a scalar, in a data file) is whole, not the
        # parameter's part, and sent every FSDP load to PyTorch's helper's step before
        assert result["steps"] == 0
        assert result["placements"] == ["(Shard(dim=0),)"]
        assert sorted(result["state"]) == sorted(stored)
        for name, value in result["state"].items():
            assert torch.equal(value, reader.read(name)), name
    # and resharded into one process, fresh, with gradients present
    model = model_of(9)
    fresh = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.5, centered=True)
    model(torch.ones(2, 16)).sum().backward()
    ss.load({"model": model, "optim": fresh}, path)
    for name, state in get_optimizer_state_dict(model, fresh)["state"].items():
        for key, value in state.items():
            assert torch.equal(value, reader.read(f"optim.state.{name}.{key}")), (name, key)


@pytest.mark.parametrize("saver", ["ss.save", "Checkpointer"])
def test_a_save_of_a_stateless_optimizer_makes_no_gradients(tmp_path, monkeypatch, saver):
    """PyTorch's helper gives every parameter a zero gradient before it steps a fresh optimizer
    (and the step was then held back): a copy of the parameters' size made and dropped again at
    every save of a plain SGD, which has no state after any number of steps. The helper now
    takes the optimizer as made and does neither."""
    model = model_of(0)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, optim, 0)
    optim.zero_grad()
    params = {id(p) for p in model.parameters()}
    made = []
    zeros_like = torch.zeros_like
    monkeypatch.setattr(torch, "zeros_like", lambda t, *a, **k: (made.append(id(t)), zeros_like(t, *a, **k))[1])
    if saver == "ss.save":
        ss.save({"model": model, "optim": optim}, tmp_path / "c")
    else:
        with ss.Checkpointer(tmp_path / "root") as ckpt:
            ckpt.save(1, {"model": model, "optim": optim}).wait()
    assert not params & set(made)
    assert not optim.state and all(p.grad is None for p in model.parameters())
    where = tmp_path / "c" if saver == "ss.save" else tmp_path / "root" / "step-1"
    assert ss.open(where).read("optim.param_groups")[0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_finding_the_files_a_node_local_restore_needs_leaves_a_fresh_optimizer_fresh(tmp_path):
    """Before a restore from the node-local level each rank lists the files its load reads, by
    flattening the state against the manifest: that made a fresh optimizer's state (zeros) and
    left it there, so a load that then failed left the restart with state made of zeros."""
    from statesnap.checkpointer.recovery import files_needed

    model, optim = trained("Rprop")
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    fresh_model = model_of(7)
    fresh = torch.optim.Rprop(fresh_model.parameters(), lr=0.01)
    manifest = ss.open(tmp_path / "c").manifest
    assert files_needed(manifest, {"model": fresh_model, "optim": fresh}) == set(manifest.files)
    assert not fresh.state


@pytest.mark.parametrize("groups", [1, 3])
def test_an_optimizer_of_another_number_of_param_groups_is_refused_before_anything_is_read(tmp_path, groups):
    """Saved with two param groups (decay and no decay) and loaded into an optimizer of one or
    three: PyTorch's helper maps the stored groups' hyperparameters by parameter name, so the
    one group took the last stored group's weight decay for every parameter, and of three, the
    one no stored group named had no lr at all (a bare KeyError at the next step). Refused by
    name now, before the model is touched."""
    def built(seed: int, count: int):
        model = model_of(seed)
        params = list(model.parameters())
        cuts = {1: [params], 2: [params[:2], params[2:]], 3: [params[:1], params[1:2], params[2:]]}[count]
        return model, torch.optim.SGD([{"params": p, "weight_decay": 0.1 * i} for i, p in enumerate(cuts)],
                                      lr=0.1, momentum=0.9)

    model, optim = built(0, 2)
    step(model, optim, 0)
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    fresh_model, fresh = built(7, groups)
    before = [p.detach().clone() for p in fresh_model.parameters()]
    with pytest.raises(ss.StateMismatchError, match=rf"optim: the checkpoint's optimizer has 2 param group\(s\), "
                                                    rf"this one {groups}") as caught:
        ss.load({"model": fresh_model, "optim": fresh}, tmp_path / "c")
    assert caught.value.mismatched == ["optim.param_groups"]
    assert all(torch.equal(p, q) for p, q in zip(before, fresh_model.parameters())) and not fresh.state
    ss.load({"model": fresh_model}, tmp_path / "c", partial=True)  # the advice: the model alone
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh_model.parameters()))


@pytest.mark.parametrize("target", ["fresh", "stepped", "positional"])
def test_the_same_parameters_grouped_otherwise_are_refused_before_anything_is_read(tmp_path, target):
    """As many param groups, other members (the layers' weights and biases against layer by
    layer): the stored groups' hyperparameters would go to other parameters (1.weight's weight
    decay of 0.3 to another), or a group got none (a KeyError at the next step). Refused by name,
    whether the optimizer is fresh or has stepped, keyed by name or by position."""
    def built(seed: int, by_layer: bool):
        model = model_of(seed)
        w0, b0, w1, b1 = model.parameters()
        cuts = [[w0, b0], [w1, b1]] if by_layer else [[w0], [b0, w1, b1]]
        return model, torch.optim.SGD([{"params": p, "lr": lr, "weight_decay": decay}
                                       for p, lr, decay in zip(cuts, [0.05, 0.01], [0.0, 0.3])], momentum=0.9)

    model, optim = built(0, by_layer=True)
    step(model, optim, 0)
    state = (lambda m, o: {"model": m, "optim": o}) if target != "positional" else (lambda m, o: {"optim": o})
    ss.save(state(model, optim), tmp_path / "c")
    fresh_model, fresh = built(7, by_layer=False)
    if target == "stepped":
        step(fresh_model, fresh, 1)
    before = {k: v["momentum_buffer"].clone() for k, v in fresh.state_dict()["state"].items()}
    with pytest.raises(ss.StateMismatchError, match="optim: the checkpoint's optimizer groups its parameters "
                                                    "otherwise than this one") as caught:
        ss.load(state(fresh_model, fresh), tmp_path / "c")
    assert caught.value.mismatched == ["optim.param_groups"]
    assert [g["weight_decay"] for g in fresh.param_groups] == [0.0, 0.3]
    after = {k: v["momentum_buffer"] for k, v in fresh.state_dict()["state"].items()}
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    same_model, same = built(7, by_layer=True)  # grouped as saved: loads, every value exact
    ss.load(state(same_model, same), tmp_path / "c")
    assert [(g["lr"], g["weight_decay"]) for g in same.param_groups] == [(0.05, 0.0), (0.01, 0.3)]
    for p, q in zip(optim.param_groups, same.param_groups):
        assert all(torch.equal(optim.state[a]["momentum_buffer"], same.state[b]["momentum_buffer"])
                   for a, b in zip(p["params"], q["params"]))


def test_a_regrouping_is_refused_when_the_optimizer_also_holds_a_parameter_the_checkpoint_s_did_not(tmp_path):
    """The check for regrouped parameters was skipped when the optimizer held one parameter more
    than the checkpoint's (unfrozen since): the layers' weights then took the biases' lr and
    weight decay, and the new parameter's group got none (a KeyError at the next step)."""
    def built(seed: int):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model.register_parameter("extra", nn.Parameter(torch.zeros(3)))
        return model
    model = built(0)
    weights, biases = [model[0].weight, model[1].weight], [model[0].bias, model[1].bias]
    optim = torch.optim.AdamW([dict(params=weights, lr=1e-2, weight_decay=0.1),
                               dict(params=biases, lr=1e-3, weight_decay=0.0)])
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    fresh_model = built(1)
    merged = [*fresh_model[0].parameters(), *fresh_model[1].parameters()]
    fresh = torch.optim.AdamW([dict(params=merged, lr=1e-2, weight_decay=0.1),
                               dict(params=[fresh_model.extra], lr=1e-3, weight_decay=0.0)])
    with pytest.raises(ss.StateMismatchError, match=r"groups its parameters otherwise than this one "
                                                    r"\(0.bias, 1.bias lie in another param group\)"):
        ss.load({"model": fresh_model, "optim": fresh}, tmp_path / "c")
    assert [(g["lr"], g["weight_decay"]) for g in fresh.param_groups] == [(1e-2, 0.1), (1e-3, 0.0)]
    kept = built(2)  # grouped as saved, the new parameter in a group of its own: loads
    same = torch.optim.AdamW([dict(params=[kept[0].weight, kept[1].weight, kept.extra], lr=1e-2, weight_decay=0.1),
                              dict(params=[kept[0].bias, kept[1].bias], lr=1e-3, weight_decay=0.0)])
    ss.load({"model": kept, "optim": same}, tmp_path / "c")
    assert [(g["lr"], g["weight_decay"]) for g in same.param_groups] == [(1e-2, 0.1), (1e-3, 0.0)]
    assert torch.equal(same.state[kept[0].weight]["exp_avg"], optim.state[model[0].weight]["exp_avg"])


def _pipeline_stage_groups(rank, world, path):
    """Stage ``rank`` of a pipeline holding layers of its own, with two param groups."""
    def stage(seed):
        torch.manual_seed(seed + rank)
        model = nn.ModuleDict({"layers": nn.ModuleDict({str(2 * rank + i): nn.Linear(4, 4) for i in range(2)})})
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        return model, torch.optim.AdamW([dict(params=weights, lr=1e-2, weight_decay=0.1),
                                         dict(params=biases, lr=1e-3, weight_decay=0.0)])
    model, optim = stage(0)
    sum(p.sum() for p in model.parameters()).backward()
    optim.step()
    ss.save({"model": model, "optim": optim}, path)
    fresh_model, fresh = stage(50)
    ss.load({"model": fresh_model, "optim": fresh}, path)
    groups = [(g["lr"], g["weight_decay"], g["betas"]) for g in fresh.param_groups]
    moments = all(torch.equal(optim.state[p]["exp_avg"], fresh.state[q]["exp_avg"])
                  for p, q in zip(model.parameters(), fresh_model.parameters()))
    sum(p.sum() for p in fresh_model.parameters()).backward()
    fresh.step()
    return groups, moments


def test_pipeline_stages_keep_their_param_groups_hyperparameters(tmp_path):
    """The stored groups are rank 0's, naming its parameters: the second stage's groups matched
    none of them and were left without lr or betas (a KeyError at the next step)."""
    results = run_ranks(2, _pipeline_stage_groups, str(tmp_path / "c"))
    assert results == [([(1e-2, 0.1, (0.9, 0.999)), (1e-3, 0.0, (0.9, 0.999))], True)] * 2


def test_an_optimizer_built_from_named_parameters_loads_its_groups_and_state(tmp_path):
    """Groups that list param_names beside their params keep both this rank's, with the
    stored hyperparameters."""
    def built(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        cuts = [[(n, p) for n, p in model.named_parameters() if n.endswith(end)] for end in ("weight", "bias")]
        return model, torch.optim.AdamW([dict(params=[p for _, p in cut], param_names=[n for n, _ in cut], lr=lr)
                                         for cut, lr in zip(cuts, (1e-2, 1e-3))])
    model, optim = built(0)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    fresh_model, fresh = built(1)
    for group in fresh.param_groups:
        group["lr"] = 5.0
    ss.load({"model": fresh_model, "optim": fresh}, tmp_path / "c")
    assert [(g["lr"], g["param_names"]) for g in fresh.param_groups] == [(1e-2, ["0.weight", "1.weight"]),
                                                                        (1e-3, ["0.bias", "1.bias"])]
    assert all(torch.equal(optim.state[a]["exp_avg"], fresh.state[b]["exp_avg"])
               for a, b in zip(model.parameters(), fresh_model.parameters()))


def test_state_kept_by_position_of_another_parameter_s_shape_is_refused_in_a_fresh_optimizer_too(tmp_path):
    """An optimizer alone in the state keeps its state by position. Loaded into a fresh one whose
    parameters come in another order, the state was made in the stored shapes and put on the
    wrong parameters: the load passed and the next step failed ("output with shape [4] doesn't
    match the broadcast shape [4, 4]"). It is refused as it is for an optimizer that has stepped."""
    params = [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))]
    optim = torch.optim.Adam(params, lr=0.1)
    optim.zero_grad()
    sum(p.sum() for p in params).backward()
    optim.step()
    ss.save({"optim": optim}, tmp_path / "c")
    swapped = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4, 4))]
    fresh = torch.optim.Adam(swapped, lr=0.1)
    with pytest.raises(ss.StateMismatchError, match=r"optim.state.0.exp_avg \(checkpoint float32\[4, 4\], "
                                                    r"target float32\[4\]\)"):
        ss.load({"optim": fresh}, tmp_path / "c")
    assert not fresh.state  # left fresh
    same = torch.optim.Adam([nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))], lr=0.1)
    ss.load({"optim": same}, tmp_path / "c")
    assert_same_state(optim, same)


# ---- a load replaces a stepped optimizer's state as a whole, as its load_state_dict does ----
def _frozen_then_stepped():
    """Layer 1 frozen: a step gives state to layer 0's parameters only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].requires_grad_(False)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _unfreezing_run(tmp_path):
    """Layer 1 frozen at the save, unfrozen and stepped since: the live optimizer holds state for
    parameters the checkpoint keeps none for (a rollback past the unfreezing)."""
    model, optim = _frozen_then_stepped()
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    model[1].requires_grad_(True)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _state_bytes(optim) -> list:
    return [(k, v.clone() if isinstance(v, torch.Tensor) else v) for p in optim.param_groups[0]["params"]
            for k, v in sorted(optim.state.get(p, {}).items())]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(ka == kb and (torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb)
                                    for (ka, va), (kb, vb) in zip(a, b))


def test_a_rollback_past_new_optimizer_state_loads_the_stored_state_whole(tmp_path):
    model, optim = _unfreezing_run(tmp_path)
    ss.load({"model": model, "optim": optim}, tmp_path / "c")
    fresh_model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=0.01)
    ss.load({"model": fresh_model, "optim": fresh}, tmp_path / "c")
    assert len(optim.state) == len(fresh.state) == 2  # no state for the layer unfrozen since
    assert _same(_state_bytes(optim), _state_bytes(fresh))
    for m, o in ((model, optim), (fresh_model, fresh)):  # and both train on alike, bit for bit
        torch.manual_seed(1)
        m(torch.randn(2, 4)).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))
    assert _same(_state_bytes(optim), _state_bytes(fresh))


def test_a_checkpoint_saved_before_the_first_step_empties_a_stepped_optimizer(tmp_path):
    model = nn.Linear(4, 4)
    optim = torch.optim.Adam(model.parameters())
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    ss.load({"model": model, "optim": optim}, tmp_path / "c")
    assert not optim.state


def test_a_failed_load_gives_the_replaced_optimizer_state_back(tmp_path):
    model, optim = _unfreezing_run(tmp_path)
    before = _state_bytes(optim)
    held = [optim.state[p] for p in model.parameters()]
    data = next(f for f in (tmp_path / "c").iterdir() if f.suffix != ".json")
    data.write_bytes(bytes(b ^ 0xFF for b in data.read_bytes()))  # (every tensor damaged)
    with pytest.raises(ss.CorruptCheckpointError):
        ss.load({"model": model, "optim": optim}, tmp_path / "c")
    assert _same(_state_bytes(optim), before) and [optim.state[p] for p in model.parameters()] == held


def test_a_load_that_holds_no_optimizer_leaves_its_state(tmp_path):
    model, optim = _unfreezing_run(tmp_path)
    ss.save({"model": model}, tmp_path / "weights")
    before = _state_bytes(optim)
    ss.load({"model": model, "optim": optim}, tmp_path / "weights", strict=False)
    assert _same(_state_bytes(optim), before)


def test_load_latest_rolls_back_past_new_optimizer_state_from_memory_and_disk(tmp_path):
    model, optim = _frozen_then_stepped()
    state = {"model": model, "optim": optim}
    with ss.Checkpointer(tmp_path / "root") as ckpt:
        ckpt.save(1, state).wait()
        stored = _state_bytes(optim)
        model[1].requires_grad_(True)
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        assert len(optim.state) == 4
        assert ckpt.load_latest(state) == 1 and ckpt.loaded_from == "memory"
        assert len(optim.state) == 2 and _same(_state_bytes(optim), stored)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    with ss.Checkpointer(tmp_path / "root") as ckpt:
        assert ckpt.load_latest(state) == 1 and ckpt.loaded_from == "persistent"
        assert len(optim.state) == 2 and _same(_state_bytes(optim), stored)


def test_a_load_keeps_a_stepped_optimizers_state_where_the_checkpoint_cannot_replace_it(tmp_path):
    """Replacing is for state the checkpoint keeps for the parameters its own groups list: a
    parameter it does not know, another kind of optimizer's state, or state for a parameter
    frozen now (PyTorch's helper would drop it without a word) leave the optimizer's own state,
    reported as a mismatch as before (strict=False: left as it was)."""
    torch.manual_seed(0)
    small = nn.Sequential(nn.Linear(2, 2))
    small_optim = torch.optim.Adam(small.parameters())
    small(torch.randn(1, 2)).sum().backward()
    small_optim.step()
    ss.save({"model": small, "optim": small_optim}, tmp_path / "small")
    sgd = torch.optim.SGD(small.parameters(), lr=0.1, momentum=0.9)
    sgd.step()
    ss.save({"model": small, "optim": sgd}, tmp_path / "sgd")

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optim = torch.optim.Adam(model.parameters())
    for _ in range(3):
        model(torch.randn(1, 2)).sum().backward()
        optim.step()
    before = _state_bytes(optim)
    info = ss.load({"model": model, "optim": optim}, tmp_path / "small", strict=False)  # layer 1 unknown there
    assert any(name.startswith("optim.state.1.") for name in info.missing)
    assert _same(_state_bytes(optim)[6:], before[6:]) and len(optim.state) == 4
    wrapped = {"model": nn.ModuleDict({"net": model}), "optim": optim}  # other names: nothing matches
    ss.load(wrapped, tmp_path / "small", strict=False)
    assert _same(_state_bytes(optim)[6:], before[6:]) and len(optim.state) == 4
    adam = torch.optim.Adam(small.parameters())
    small(torch.randn(1, 2)).sum().backward()
    adam.step()
    before = _state_bytes(adam)
    with pytest.raises(ss.StateMismatchError, match="optim.state.0.weight.exp_avg"):  # SGD's state into an Adam
        ss.load({"model": small, "optim": adam}, tmp_path / "sgd")
    assert _same(_state_bytes(adam), before)

    model, optim = _frozen_then_stepped()
    model[1].requires_grad_(True)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    ss.save({"model": model, "optim": optim}, tmp_path / "both")
    model, optim = _frozen_then_stepped()  # layer 1 frozen, without state: the checkpoint keeps its state
    with pytest.raises(ss.StateMismatchError, match="unexpected in checkpoint .*optim.state.1.weight"):
        ss.load({"model": model, "optim": optim}, tmp_path / "both")


def test_an_optimizer_under_a_top_level_empty_key_keeps_its_state_on_a_weights_only_load(tmp_path):
    model, optim = _frozen_then_stepped()
    ss.save({"model": model}, tmp_path / "weights")
    before = _state_bytes(optim)
    ss.load({"model": model, "": optim}, tmp_path / "weights", strict=False)
    assert _same(_state_bytes(optim), before)


def test_a_positional_optimizer_is_replaced_too_and_a_load_of_what_matches_replaces_nothing(tmp_path):
    """No module owns the parameters (state kept by position): a strict rollback past an unfreeze
    replaces its state as for a module's optimizer. A load of what matches (strict=False) never
    replaces: what the checkpoint lacks keeps the optimizer's own values and is reported."""
    model, optim = _frozen_then_stepped()
    params = list(model.parameters())
    positional = torch.optim.AdamW(params, lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    positional.step()
    ss.save({"params": params[:2], "optim": positional}, tmp_path / "c")
    model[1].requires_grad_(True)
    model(torch.randn(2, 4)).sum().backward()
    positional.step()
    before = _state_bytes(positional)
    info = ss.load({"params": params[:2], "optim": positional}, tmp_path / "c", strict=False)
    assert _same(_state_bytes(positional)[6:], before[6:]) and len(positional.state) == 4  # (layer 1's, kept)
    assert any(name.startswith("optim.state.2.") for name in info.missing)
    ss.load({"params": params[:2], "optim": positional}, tmp_path / "c")
    assert len(positional.state) == 2


def test_optimizers_over_part_of_a_module_keep_the_names_of_the_whole_module(tmp_path):
    """An optimizer per parameter (optimizers in backward) made every save walk the whole model
    once per optimizer, in PyTorch's helper: quadratic. Such an optimizer is handed a module of
    only its parameters, under the names the whole module gives them: the checkpoint is the same."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    per_param = {name: torch.optim.AdamW([p], lr=0.01) for name, p in model.named_parameters()}
    halves = [torch.optim.SGD(list(model[0].parameters()), lr=0.1, momentum=0.9),
              torch.optim.Adam(list(model[1].parameters()))]
    model(torch.randn(2, 3)).sum().backward()
    for optim in [*per_param.values(), *halves]:
        optim.step()
    state = {"model": model, "per_param": per_param, "halves": halves}
    ss.save(state, tmp_path / "c")
    keys = set(ss.open(tmp_path / "c").keys())
    for fqn, optim in [*((f"per_param.{n}", o) for n, o in per_param.items()),
                       *((f"halves.{i}", o) for i, o in enumerate(halves))]:
        expected = get_optimizer_state_dict(model, optim)["state"]
        assert {f"{fqn}.state.{p}.{k}" for p, s in expected.items() for k in s} <= keys

    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    target = {"model": fresh,
              "per_param": {name: torch.optim.AdamW([p], lr=0.01) for name, p in fresh.named_parameters()},
              "halves": [torch.optim.SGD(list(fresh[0].parameters()), lr=0.1, momentum=0.9),
                         torch.optim.Adam(list(fresh[1].parameters()))]}
    ss.load(target, tmp_path / "c")
    for mine, theirs in zip([*per_param.values(), *halves], [*target["per_param"].values(), *target["halves"]]):
        assert _same(_state_bytes(mine), _state_bytes(theirs))
