"""Blocking ss.save / ss.load: what a training state holds, in place, strictly, resumably, atomically."""
import collections
import copy
import enum
import importlib
import os
import struct
import warnings

import fsspec
import numpy as np
import pytest
import torch
import torch.nn as nn

import statesnap as ss
from statesnap.format import plaindata
from statesnap.state.owners import OwnerFinder
from dist_utils import run_ranks


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def make_training(seed: int = 0):
    model = make_model(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def train(model, optim, sched, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = ((model(x) - y) ** 2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        losses.append(loss.item())
    return losses


class Counter:
    """A user object with the Stateful protocol."""

    def __init__(self, n=0):
        self.n, self.history = n, [n]

    def state_dict(self):
        return {"n": self.n, "history": list(self.history), "weights": torch.full((3,), float(self.n))}

    def load_state_dict(self, sd):
        self.n, self.history = sd["n"], list(sd["history"])
        assert torch.equal(sd["weights"], torch.full((3,), float(self.n)))


def full_state(model, optim, sched, counter, step):
    return {"model": model, "optim": optim, "sched": sched, "counter": counter,
            "extra": {"step": step, "config": {"lr": 1e-2, "name": "tiny"}, "table": torch.arange(5)}}


def assert_same_params(a: nn.Module, b: nn.Module):
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def assert_same_optim(a: torch.optim.Optimizer, b: torch.optim.Optimizer):
    pa = [p for g in a.param_groups for p in g["params"]]
    pb = [p for g in b.param_groups for p in g["params"]]
    for p, q in zip(pa, pb):
        assert a.state[p].keys() == b.state[q].keys()
        for key in a.state[p]:
            assert torch.equal(a.state[p][key], b.state[q][key]), key


def test_full_training_state_round_trips(tmp_path):
    model, optim, sched = make_training()
    train(model, optim, sched, range(3))
    counter = Counter(7)
    ss.save(full_state(model, optim, sched, counter, 3), tmp_path / "c")

    keys = ss.open(tmp_path / "c").keys()
    for param in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert f"model.{param}" in keys
        assert f"optim.state.{param}.exp_avg" in keys
        assert f"optim.state.{param}.exp_avg_sq" in keys
    assert "extra.config.name" in keys and "counter.n" in keys

    model2, optim2, sched2 = make_training(seed=1)
    counter2 = Counter()
    state2 = full_state(model2, optim2, sched2, counter2, 0)
    ss.load(state2, tmp_path / "c")
    assert_same_params(model, model2)
    assert_same_optim(optim, optim2)
    assert sched2.state_dict() == sched.state_dict()
    assert optim2.param_groups[0]["lr"] == optim.param_groups[0]["lr"]
    assert counter2.n == 7 and counter2.history == [7]
    assert state2["extra"]["step"] == 3 and state2["extra"]["config"] == {"lr": 1e-2, "name": "tiny"}
    assert torch.equal(state2["extra"]["table"], torch.arange(5))


def test_load_fills_tensors_in_place(tmp_path):
    model, optim, sched = make_training()
    train(model, optim, sched, range(2))
    plain = torch.randn(10)
    ss.save({"model": model, "optim": optim, "plain": plain}, tmp_path / "c")

    model2, optim2, _ = make_training(seed=1)
    train(model2, optim2, torch.optim.lr_scheduler.StepLR(optim2, 1), range(1))
    params = {n: p.data_ptr() for n, p in model2.named_parameters()}
    moments = [optim2.state[p]["exp_avg"].data_ptr() for p in model2.parameters()]
    target = torch.zeros(10)
    pointer = target.data_ptr()
    ss.load({"model": model2, "optim": optim2, "plain": target}, tmp_path / "c")
    assert {n: p.data_ptr() for n, p in model2.named_parameters()} == params
    assert [optim2.state[p]["exp_avg"].data_ptr() for p in model2.parameters()] == moments
    assert target.data_ptr() == pointer and torch.equal(target, plain)
    assert_same_params(model, model2)


def test_fresh_optimizer_loads_state_and_next_step_matches(tmp_path):
    model, optim, sched = make_training()
    train(model, optim, sched, range(3))
    ss.save({"model": model, "optim": optim, "sched": sched}, tmp_path / "c")

    model2, optim2, sched2 = make_training(seed=5)
    assert not optim2.state  # has taken no step
    ss.load({"model": model2, "optim": optim2, "sched": sched2}, tmp_path / "c")
    assert_same_optim(optim, optim2)
    assert train(model2, optim2, sched2, range(3, 4)) == train(model, optim, sched, range(3, 4))
    assert_same_params(model, model2)
    assert_same_optim(optim, optim2)


def _encoder_decoder(seed: int):
    torch.manual_seed(seed)
    enc, dec = nn.Linear(4, 3), nn.Sequential(nn.Linear(3, 2))
    return enc, dec, torch.optim.AdamW([*enc.parameters(), *dec.parameters()], lr=0.1)


def _step(enc, dec, optim, seed: int) -> float:
    torch.manual_seed(seed)
    optim.zero_grad()
    loss = dec(enc(torch.randn(5, 4))).square().sum()
    loss.backward()
    optim.step()
    return loss.item()


def test_an_optimizer_over_several_modules_of_the_state_is_keyed_by_their_names(tmp_path):
    """An encoder and a decoder under their own keys, one optimizer over both: its state is
    keyed by the parameters' names in the state (not by position), so it loads into a fresh
    optimizer, as after a restart, and training continues bit for bit."""
    enc, dec, optim = _encoder_decoder(0)
    _step(enc, dec, optim, 1)
    ss.save({"enc": enc, "models": {"dec": dec}, "optim": optim}, tmp_path / "c")
    keys = ss.open(tmp_path / "c").keys()
    assert "optim.state.enc.weight.exp_avg" in keys and "optim.state.models.dec.0.bias.step" in keys

    enc2, dec2, optim2 = _encoder_decoder(7)
    assert not optim2.state
    ss.load({"enc": enc2, "models": {"dec": dec2}, "optim": optim2}, tmp_path / "c")
    assert_same_optim(optim, optim2)
    assert _step(enc2, dec2, optim2, 2) == _step(enc, dec, optim, 2)
    assert_same_params(enc, enc2)
    assert_same_params(dec, dec2)


def test_optimizers_over_modules_in_lists_are_keyed_by_their_names(tmp_path):
    """Modules in a list (``{"models": [enc, dec]}``) are walked by index, and their optimizers'
    state is now keyed by those names, as for modules in dicts (it was kept by position, which
    cannot reshard), so a fresh optimizer takes it and training continues bit for bit. A
    checkpoint that kept such state by position still loads, into a fresh optimizer too."""
    enc, dec, optim = _encoder_decoder(0)
    _step(enc, dec, optim, 1)
    ss.save({"models": [enc, dec], "optim": optim}, tmp_path / "shared")
    assert "optim.state.models.0.weight.exp_avg" in ss.open(tmp_path / "shared").keys()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(OwnerFinder, "owner_of", lambda self, optim: None)  # what the old save did
        ss.save({"models": [enc, dec], "optim": optim}, tmp_path / "positional")
    saved_enc = {k: v.clone() for k, v in enc.state_dict().items()}
    per_module = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (enc, dec)]
    _step(enc, dec, per_module[0], 2)
    per_module[1].step()
    ss.save({"models": (enc, dec), "optims": per_module}, tmp_path / "each")
    assert "optims.1.state.0.weight.momentum_buffer" in ss.open(tmp_path / "each").keys()  # dec is a Sequential

    for name in ("shared", "positional"):
        enc2, dec2, optim2 = _encoder_decoder(7)
        ss.load({"models": [enc2, dec2], "optim": optim2}, tmp_path / name)
        assert_same_optim(optim, optim2)
        assert all(torch.equal(v, saved_enc[k]) for k, v in enc2.state_dict().items())
    enc2, dec2, _ = _encoder_decoder(7)
    per_module2 = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (enc2, dec2)]
    ss.load({"models": (enc2, dec2), "optims": per_module2}, tmp_path / "each")
    for a, b in zip(per_module, per_module2):
        assert_same_optim(a, b)
    assert _step(enc2, dec2, per_module2[0], 3) == _step(enc, dec, per_module[0], 3)
    assert_same_params(enc, enc2)


def test_modules_under_digit_keys_share_an_optimizer(tmp_path):
    """Names under digit keys (``optim.state.0.weight.exp_avg``) are not taken for positions."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 3), nn.Linear(3, 2)
    optim = torch.optim.Adam([*a.parameters(), *b.parameters()])
    b(a(torch.randn(5, 4))).sum().backward()
    optim.step()
    ss.save({"0": a, "1": b, "optim": optim}, tmp_path / "c")
    assert "optim.state.0.weight.exp_avg" in ss.open(tmp_path / "c").keys()
    a2, b2 = nn.Linear(4, 3), nn.Linear(3, 2)
    optim2 = torch.optim.Adam([*a2.parameters(), *b2.parameters()])
    ss.load({"0": a2, "1": b2, "optim": optim2}, tmp_path / "c")
    assert_same_optim(optim, optim2)


def test_a_positional_checkpoint_of_such_an_optimizer_still_loads(tmp_path, monkeypatch):
    """Before the state was named, an optimizer over several modules was saved by position: such
    a checkpoint still loads into an optimizer that has stepped, as it did."""
    enc, dec, optim = _encoder_decoder(0)
    _step(enc, dec, optim, 1)
    with monkeypatch.context() as m:
        m.setattr(OwnerFinder, "owner_of", lambda self, optim: None)  # what the old save did
        ss.save({"enc": enc, "dec": dec, "optim": optim}, tmp_path / "c")
    assert "optim.state.0.exp_avg" in ss.open(tmp_path / "c").keys()
    enc2, dec2, optim2 = _encoder_decoder(7)
    _step(enc2, dec2, optim2, 3)
    ss.load({"enc": enc2, "dec": dec2, "optim": optim2}, tmp_path / "c")
    assert_same_optim(optim, optim2)


def _with_temperature(seed: int, reverse: bool):
    """A model and a learned temperature beside it, one optimizer over both (listed in reverse
    where asked: another run's order)."""
    torch.manual_seed(seed)
    model, temperature = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Parameter(torch.full((4, 4), 0.5))
    params = [*model.parameters(), temperature]
    return model, temperature, torch.optim.Adam(params[::-1] if reverse else params, lr=0.1)


def _step_with_temperature(model, temperature, optim) -> None:
    optim.zero_grad()
    (model(torch.ones(2, 4)) @ temperature).square().sum().backward()
    optim.step()


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
def test_parameters_held_beside_the_modules_name_the_optimizer_state_too(tmp_path, stepped, monkeypatch):
    """One parameter of the optimizer in no module of the state (``extra.temperature``) made the
    whole optimizer's state be kept by position: a run that listed the parameters in another
    order loaded each one another's moments (shapes alike), without a word. The parameter is now
    named as the state names it; a checkpoint kept by position still loads as before."""
    model, temperature, optim = _with_temperature(0, reverse=False)
    for _ in range(2):
        _step_with_temperature(model, temperature, optim)
    state = {"model": model, "extra": {"temperature": temperature}, "optim": optim}
    ss.save(state, tmp_path / "c")
    assert {"optim.state.extra.temperature.exp_avg", "optim.state.model.1.bias.exp_avg"} <= set(
        ss.open(tmp_path / "c").keys())
    model2, temperature2, optim2 = _with_temperature(1, reverse=True)
    if stepped:
        _step_with_temperature(model2, temperature2, optim2)
    ss.load({"model": model2, "extra": {"temperature": temperature2}, "optim": optim2}, tmp_path / "c")
    for a, b in zip([*model.parameters(), temperature], [*model2.parameters(), temperature2]):
        assert all(torch.equal(optim.state[a][k], optim2.state[b][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    with monkeypatch.context() as m:
        m.setattr(OwnerFinder, "owner_of", lambda self, optim: None)  # what the old save did
        ss.save(state, tmp_path / "old")
    assert "optim.state.4.exp_avg" in ss.open(tmp_path / "old").keys()
    model3, temperature3, optim3 = _with_temperature(2, reverse=False)
    ss.load({"model": model3, "extra": {"temperature": temperature3}, "optim": optim3}, tmp_path / "old")
    assert_same_optim(optim, optim3)


def test_a_parameter_named_through_a_module_of_the_state_leaves_the_module_as_it_was(tmp_path):
    """A state key that runs into a module (``model.extra.temperature`` beside ``model``) cannot
    name the parameter without a place inside the module: naming it so added a submodule to the
    user's model, whose next forward failed. Such an optimizer keeps its state by position."""
    model, temperature = nn.Sequential(nn.Linear(4, 4)), nn.Parameter(torch.ones(4))
    optim = torch.optim.SGD([*model.parameters(), temperature], lr=0.1, momentum=0.9)
    (model(torch.ones(1, 4)) * temperature).sum().backward()
    optim.step()
    state = {"model": model, "model.extra.temperature": temperature, "optim": optim}
    for attempt in range(2):
        ss.save(state, tmp_path / f"c{attempt}")
        assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias"]
    assert "optim.state.2.momentum_buffer" in ss.open(tmp_path / "c0").keys()
    model(torch.ones(1, 4))
    model2, temperature2 = nn.Sequential(nn.Linear(4, 4)), nn.Parameter(torch.zeros(4))
    optim2 = torch.optim.SGD([*model2.parameters(), temperature2], lr=0.1, momentum=0.9)
    ss.load({"model": model2, "model.extra.temperature": temperature2, "optim": optim2}, tmp_path / "c0")
    assert_same_optim(optim, optim2)


def test_a_positional_checkpoint_of_parameters_under_digit_keys_still_loads_by_position(tmp_path, monkeypatch):
    """``{0: p0, 1: p1}``: named now, a parameter is "0", which an older checkpoint kept by
    position also writes (``optim.state.0``, meaning the optimizer's first parameter). The stored
    param groups tell them apart: positions are integers there, names strings."""
    torch.manual_seed(0)
    p0, p1 = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    optim = torch.optim.Adam([p1, p0], lr=0.1)  # the first parameter is p1
    for _ in range(2):
        optim.zero_grad()
        (p0.square().sum() + 10 * p1.sum()).backward()
        optim.step()
    with monkeypatch.context() as m:
        m.setattr(OwnerFinder, "owner_of", lambda self, optim: None)  # what the old save did
        ss.save({0: p0, 1: p1, "optim": optim}, tmp_path / "old")
    ss.save({0: p0, 1: p1, "optim": optim}, tmp_path / "new")
    for name in ("old", "new"):
        q0, q1 = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))
        fresh = torch.optim.Adam([q1, q0], lr=0.1)
        ss.load({0: q0, 1: q1, "optim": fresh}, tmp_path / name)
        assert_same_optim(optim, fresh)


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
                                  lambda ps: torch.optim.RMSprop(ps, lr=0.01),
                                  lambda ps: torch.optim.Adagrad(ps, lr=0.1)], ids=["sgd", "rmsprop", "adagrad"])
@pytest.mark.parametrize("kind", ["parameters", "plain tensors"])
def test_an_optimizer_alone_of_another_kind_loads_into_a_fresh_one(tmp_path, make, kind):
    """Its state is created by its own first step (SGD's momentum is the first gradient), so
    nothing was there to fill: a strict load failed, and ``strict=False`` dropped the state.
    Now the fresh optimizer's state is created as for an owned one, then filled, and the next
    step is the same bit for bit."""
    def tensors(seed):
        torch.manual_seed(seed)
        made = [torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)]
        return [nn.Parameter(t.detach()) for t in made] if kind == "parameters" else made

    def step(params, optim, seed):
        torch.manual_seed(seed)
        optim.zero_grad()
        sum((p * torch.randn(p.shape)).square().sum() for p in params).backward()
        optim.step()

    params = tensors(0)
    optim = make(params)
    for seed in (1, 2):
        step(params, optim, seed)
    ss.save({"optim": optim, "params": params}, tmp_path / "c")
    params2 = tensors(9)
    optim2 = make(params2)
    ss.load({"optim": optim2, "params": params2}, tmp_path / "c")
    assert_same_optim(optim, optim2)
    step(params, optim, 3)
    step(params2, optim2, 3)
    assert all(torch.equal(a, b) for a, b in zip(params, params2))
    assert_same_optim(optim, optim2)


def test_an_optimizer_alone_in_the_state_loads_into_a_fresh_one(tmp_path):
    """No module in the state holds its parameters: its state is kept by position, and a fresh
    Adam(W) takes it (before, the load found nothing to fill and a strict one failed)."""
    enc, dec, optim = _encoder_decoder(0)
    _step(enc, dec, optim, 1)
    ss.save({"optim": optim}, tmp_path / "c")
    assert "optim.state.0.exp_avg" in ss.open(tmp_path / "c").keys()
    enc2, dec2, optim2 = _encoder_decoder(0)
    ss.load({"optim": optim2}, tmp_path / "c")
    assert_same_optim(optim, optim2)


def _lbfgs_run(width: int, seed: int):
    torch.manual_seed(seed)
    model = nn.Linear(width, 2)
    optim = torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=3, max_iter=4)
    batch = torch.randn(5, width, generator=torch.Generator().manual_seed(1))

    def closure():
        optim.zero_grad()
        loss = model(batch).square().sum()
        loss.backward()
        return loss
    return model, optim, closure


@pytest.mark.parametrize("width", [4, 150_000], ids=["history inline", "history in data files"])
def test_a_fresh_lbfgs_loads_its_history_and_steps_on_exactly(tmp_path, width):
    """LBFGS keeps its state (the history of directions and steps, lists of flat tensors) under
    its first parameter, and its step needs a closure, so PyTorch's helper cannot make a fresh
    one's state with a step at lr 0: the load makes it from the checkpoint instead, the lists of
    large tensors included, and two more steps match the run that saved it bit for bit."""
    model, optim, closure = _lbfgs_run(width, 0)
    for _ in range(2):
        optim.step(closure)
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    walked = [k for k in ss.open(tmp_path / "c").keys() if ".old_dirs." in k]
    assert bool(walked) == (width > 4)  # (tensors over 1 MiB are not kept inline)
    target, fresh, fresh_closure = _lbfgs_run(width, 7)
    ss.load({"model": target, "optim": fresh}, tmp_path / "c")
    assert fresh.param_groups[0]["lr"] == 0.5
    for _ in range(2):
        optim.step(closure)
        fresh.step(fresh_closure)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), target.parameters()))
    mine, theirs = optim.state[next(model.parameters())], fresh.state[next(target.parameters())]
    assert mine.keys() == theirs.keys() and mine["n_iter"] == theirs["n_iter"]
    assert all(torch.equal(a, b) for a, b in zip(mine["old_dirs"], theirs["old_dirs"], strict=True))


class _ClosureOnly(torch.optim.Optimizer):
    """An optimizer of its own whose step needs a closure (as LBFGS's does) and keeps state."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.5})

    def step(self, closure):
        closure()
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["seen"] = self.state[p].get("seen", torch.zeros_like(p)) + p.grad
                p.data.add_(p.grad, alpha=-group["lr"])


def test_a_fresh_optimizer_of_its_own_whose_step_needs_a_closure_is_refused_clearly(tmp_path):
    """PyTorch's helper creates the state of a fresh optimizer that is not one of PyTorch's with
    a step at lr 0 and no closure, which one needing a closure refuses: a CheckpointError that
    says so, and the lr is put back."""
    model = nn.Linear(4, 2)
    optim = _ClosureOnly(model.parameters())

    def closure():
        optim.zero_grad()
        loss = model(torch.ones(3, 4)).square().sum()
        loss.backward()
        return loss
    optim.step(closure)
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    target = nn.Linear(4, 2)
    fresh = _ClosureOnly(target.parameters())
    with pytest.raises(ss.CheckpointError, match="_ClosureOnly has no state yet.*closure"):
        ss.load({"model": target, "optim": fresh}, tmp_path / "c")
    assert fresh.param_groups[0]["lr"] == 0.5 and not fresh.state


class _EmaSGD(torch.optim.SGD):
    """A stateless SGD (no momentum) that also keeps an EMA of its first parameter in its step."""

    def __init__(self, params, ema):
        super().__init__(params, lr=0.1)
        self.ema, self.calls = ema, 0

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        super().step(closure)
        self.ema.mul_(0.5).add_(self.param_groups[0]["params"][0], alpha=0.5)


@pytest.mark.parametrize("saver", ["ss.save", "Checkpointer"])
def test_a_save_never_steps_the_optimizer(tmp_path, saver):
    """PyTorch's state-dict helper creates a stateless optimizer's state with a step at lr 0.
    A stateless SGD has none after any number of steps, so saves took that step for it: its
    subclass's EMA got an extra update (the checkpoint of step 1 held an EMA that never was) and
    its step hooks ran. Training with saves is now the training without them, bit for bit, and
    each checkpoint holds the EMA of its step."""
    def train(save):
        torch.manual_seed(0)
        model, ema = nn.Linear(8, 8), torch.zeros(8, 8)
        optim = _EmaSGD(model.parameters(), ema)
        hooked = []
        optim.register_step_post_hook(lambda *_: hooked.append(1))
        emas = {}
        ckpt = ss.Checkpointer(tmp_path / "root", eager_copy_mb=0) if save and saver == "Checkpointer" else None
        for step in range(1, 4):
            model(torch.randn(4, 8)).sum().backward()
            optim.step()
            optim.zero_grad()
            emas[step] = ema.clone()
            state = {"model": model, "optim": optim, "ema": ema}
            if ckpt is not None:
                ckpt.save(step, state).wait()
            elif save:
                ss.save(state, tmp_path / f"step-{step}")
        if ckpt is not None:
            ckpt.close()
        assert optim.calls == 3
        return model.weight.detach().clone(), ema, emas, len(hooked)

    weight, ema, _, hooks = train(save=False)
    saved_weight, saved_ema, emas, saved_hooks = train(save=True)
    assert torch.equal(saved_weight, weight) and torch.equal(saved_ema, ema) and saved_hooks == hooks
    for step, value in emas.items():
        where = tmp_path / "root" / f"step-{step}" if saver == "Checkpointer" else tmp_path / f"step-{step}"
        if where.exists():
            assert torch.equal(ss.open(where).read("ema"), value), step


def test_a_load_into_a_fresh_optimizer_runs_none_of_its_step_hooks(tmp_path):
    """A load into an optimizer without state (a restart) creates that state with PyTorch's
    helper, which takes a step at lr 0. Its step hooks ran on that step (a step counter or an
    EMA kept by a hook counted one step per load), and the LR scheduler's wrapper marked the
    optimizer as stepped. The optimizer now loads as it was saved and nothing watching its steps
    sees the load."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    ss.save({"model": model, "optim": optim}, tmp_path / "c")

    fresh_model = nn.Linear(4, 4)
    fresh = torch.optim.SGD(fresh_model.parameters(), lr=0.1, momentum=0.9)
    torch.optim.lr_scheduler.StepLR(fresh, 2)
    seen = []
    fresh.register_step_pre_hook(lambda *_: seen.append("pre"))
    fresh.register_step_post_hook(lambda *_: seen.append("post"))
    ss.load({"model": fresh_model, "optim": fresh}, tmp_path / "c")
    assert seen == [] and not getattr(fresh, "_opt_called", False)
    assert all(p.grad is None for p in fresh_model.parameters())
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(fresh.state[q]["momentum_buffer"], optim.state[p]["momentum_buffer"])
    fresh.step()  # the hooks and the scheduler's wrapper are still in place
    assert seen == ["pre", "post"] and fresh._opt_called


def test_reading_a_name_the_checkpoint_lacks(tmp_path):
    """A CheckpointError, as every error of statesnap, and a KeyError, as a missing key is."""
    ss.save({"t": torch.ones(2)}, tmp_path / "c")
    reader = ss.open(tmp_path / "c")
    for lookup in (reader.read, reader.info):
        with pytest.raises(ss.NotInCheckpointError, match="'u' is not in checkpoint") as caught:
            lookup("u")
        assert isinstance(caught.value, ss.CheckpointError) and isinstance(caught.value, KeyError)
        assert str(caught.value).startswith("'u' is not in checkpoint")  # (not KeyError's quoted repr of it)


def test_saving_a_fresh_optimizer_leaves_it_fresh(tmp_path):
    model, optim, sched = make_training()
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    assert not optim.state  # no zero-lr step was taken on our behalf

    reference_model, reference_optim, reference_sched = make_training()
    assert train(model, optim, sched, range(2)) == train(reference_model, reference_optim, reference_sched, range(2))
    p = next(model.parameters())
    assert optim.state[p]["step"].item() == 2

    # Loading the fresh-optimizer checkpoint into a fresh optimizer keeps it fresh too.
    model3, optim3, _ = make_training()
    ss.load({"model": model3, "optim": optim3}, tmp_path / "c")
    assert not optim3.state


def test_resume_is_bit_for_bit(tmp_path):
    model, optim, sched = make_training()
    train(model, optim, sched, range(5))
    ss.save({"model": model, "optim": optim, "sched": sched, "extra": {"step": 5}}, tmp_path / "c")
    expected_losses = train(model, optim, sched, range(5, 10))

    model2, optim2, sched2 = make_training(seed=99)
    extra = {"step": 0}
    ss.load({"model": model2, "optim": optim2, "sched": sched2, "extra": extra}, tmp_path / "c")
    losses = train(model2, optim2, sched2, range(extra["step"], extra["step"] + 5))
    assert losses == expected_losses
    assert_same_params(model, model2)
    assert_same_optim(optim, optim2)
    assert sched.get_last_lr() == sched2.get_last_lr()


def test_strict_load_lists_every_mismatch(tmp_path):
    ss.save({"a": torch.zeros(3), "b": torch.zeros(2, 2), "c": torch.zeros(4), "gone": torch.zeros(1),
             "n": 1}, tmp_path / "c")
    target = {"a": torch.ones(3), "b": torch.ones(3, 2), "c": torch.ones(4, dtype=torch.float64),
              "new": torch.ones(1), "n": 0, "new_obj": 5}
    with pytest.raises(ss.StateMismatchError) as caught:
        ss.load(target, tmp_path / "c")
    err = caught.value
    assert sorted(err.missing) == ["new", "new_obj"]
    assert err.unexpected == ["gone"]
    assert [m.split(" ")[0] for m in err.mismatched] == ["b", "c"]
    message = str(err)
    for name in ("new", "new_obj", "gone", "b (checkpoint float32[2, 2], target float32[3, 2])", "c (checkpoint"):
        assert name in message
    assert torch.equal(target["a"], torch.ones(3))  # nothing was loaded

    # strict=False loads what matches, says what it left (PyTorch's own refuses another shape),
    # and warns of the names held with another shape or dtype, at the caller's line
    with pytest.warns(UserWarning, match=r"strict=False left .* shape/dtype mismatch \(2\): b \(checkpoint "
                                         r"float32\[2, 2\], target float32\[3, 2\]\), c \(.*\)\. Pass cast=True") as w:
        info = ss.load(target, tmp_path / "c", strict=False)
    assert w[0].filename == __file__
    assert sorted(info.missing) == ["new", "new_obj"] and info.mismatched == ["b", "c"]
    assert torch.equal(target["a"], torch.zeros(3)) and target["n"] == 1
    assert torch.equal(target["b"], torch.ones(3, 2)) and torch.equal(target["new"], torch.ones(1))
    assert target["new_obj"] == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # names the checkpoint holds and the state lacks: no warning
        info = ss.load({"a": torch.ones(3)}, tmp_path / "c", strict=False)
    assert info.missing == [] and info.mismatched == [] and info.bytes == 12


def test_a_partial_load_takes_a_part_but_refuses_what_does_not_match(tmp_path):
    """``partial=True``: the checkpoint's names outside the state's top-level keys are left
    unread, but under them both sides must match: every name of the state must be there with its
    shape and dtype (a model of another size is refused), and the checkpoint may hold none the
    state lacks (a model of fewer layers loaded the layers it had)."""
    ss.save({"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optim": {"m": torch.ones(4)}, "step": 3}, tmp_path / "c")
    target = {"model": {"w": torch.zeros(2, 3)}}
    ss.load(target, tmp_path / "c", partial=True)
    assert torch.equal(target["model"]["w"], torch.arange(6.0).reshape(2, 3))
    with pytest.raises(ss.StateMismatchError, match="unexpected in checkpoint"):
        ss.load(target, tmp_path / "c")
    wider = {"model": {"w": torch.zeros(2, 4)}}
    with pytest.raises(ss.StateMismatchError, match=r"shape/dtype mismatch \(1\): model.w") as caught:
        ss.load(wider, tmp_path / "c", partial=True)
    assert caught.value.unexpected == [] and torch.equal(wider["model"]["w"], torch.zeros(2, 4))
    with pytest.raises(ss.StateMismatchError, match=r"missing in checkpoint \(1\): model.b"):
        ss.load({"model": {"w": torch.zeros(2, 3), "b": torch.zeros(1)}}, tmp_path / "c", partial=True)
    ss.save({"model": {"w": torch.ones(2, 3), "layers": {"1": torch.ones(2)}}, "optim": {"m": torch.ones(4)}},
            tmp_path / "deeper")
    with pytest.raises(ss.StateMismatchError, match=r"unexpected in checkpoint \(1\): model.layers.1\.") as caught:
        ss.load(target, tmp_path / "deeper", partial=True)
    assert caught.value.unexpected == ["model.layers.1"]
    assert torch.equal(target["model"]["w"], torch.arange(6.0).reshape(2, 3))  # nothing was loaded


def test_a_tensor_where_the_checkpoint_holds_a_plain_value_is_a_mismatch_not_a_missing_name(tmp_path):
    ss.save({"x": torch.ones(2), "n": 3}, tmp_path / "c")
    with pytest.raises(ss.StateMismatchError) as caught:
        ss.load({"x": None, "n": torch.zeros(1)}, tmp_path / "c")
    assert caught.value.missing == []
    message = str(caught.value)
    assert "x (checkpoint a tensor float32[2], target a NoneType)" in message
    assert "n (checkpoint a plain value, target a tensor float32[1])" in message


BIG = (1 << 18) + 1  # float32 elements: just over what plain data inlines


def test_sequences_holding_large_tensors_modules_or_dicts_of_them_are_walked(tmp_path):
    """Lists and tuples that hold, at any depth, what plain data cannot (a large tensor, a dict
    of one, a module) are walked by index like dicts; small tensors in a list stay plain data."""
    torch.manual_seed(0)
    state = {"x": [{"w": torch.randn(BIG), "n": 3}], "t": ((torch.randn(BIG), 5, torch.ones(2)),),
             "l": [[torch.randn(BIG)]], "m": [nn.Linear(4, 4)], "small": [torch.ones(3)]}
    ss.save(state, tmp_path / "c")
    assert ss.open(tmp_path / "c").keys() == ["l.0.0", "m.0.bias", "m.0.weight", "small", "t.0.0", "t.0.1",
                                               "t.0.2", "x.0.n", "x.0.w"]
    target = {"x": [{"w": torch.zeros(BIG), "n": 0}], "t": ((torch.zeros(BIG), 5, torch.zeros(2)),),
              "l": [[torch.zeros(BIG)]], "m": [nn.Linear(4, 4)], "small": [torch.zeros(3)]}
    held = target["t"][0][2]
    ss.load(target, tmp_path / "c")
    assert torch.equal(target["x"][0]["w"], state["x"][0]["w"]) and target["x"][0]["n"] == 3
    assert torch.equal(target["t"][0][0], state["t"][0][0])
    assert target["t"][0][2] is held and torch.equal(held, torch.ones(2))  # a small tensor in a tuple: in place
    assert torch.equal(target["l"][0][0], state["l"][0][0])
    assert torch.equal(target["m"][0].weight, state["m"][0].weight)
    assert torch.equal(target["small"][0], torch.ones(3))

    # refused before anything is written: the state is as it was, tensors in data files included
    other = {"x": [{"w": torch.zeros(BIG), "n": 0}], "t": ((torch.zeros(BIG), 6, torch.zeros(2)),),
             "l": [[torch.zeros(BIG)]], "m": [nn.Linear(4, 4)], "small": [torch.zeros(3)]}
    before = copy.deepcopy(other)
    with pytest.raises(ss.CheckpointError, match="t.0.1 lies in a tuple, which a load cannot change"):
        ss.load(other, tmp_path / "c")
    _assert_same_tree(other, before)


def _assert_same_tree(a, b):
    """``a`` holds what ``b`` does, tensors bit for bit (modules by their state dicts)."""
    if isinstance(a, nn.Module):
        a, b = a.state_dict(), b.state_dict()
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same_tree(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_tree(x, y)
    else:
        assert a == b


def test_a_value_the_load_cannot_read_leaves_the_state_as_it_was(tmp_path):
    """A pickled value without allow_pickle, and a tuple's plain value of another kind or length,
    are refused before any tensor is read into the state."""
    torch.manual_seed(0)
    ss.save({"w": torch.randn(BIG), "obj": {1, 2}, "t": (torch.randn(BIG), (1, 2))}, tmp_path / "c",
            allow_pickle=True)
    refusals = [(dict(), (1, 2), ss.UnsafeCheckpointError, "obj is stored with pickle")]
    refusals += [(dict(allow_pickle=True), held, ss.CheckpointError, "t.1 lies in a tuple")
                 for held in ((1, 2, 3), [1, 2], (1.0, 2), (1, 3))]
    for options, held, kind, match in refusals:
        target = {"w": torch.zeros(BIG), "obj": None, "t": (torch.zeros(BIG), held)}
        before = copy.deepcopy(target)
        with pytest.raises(kind, match=match):
            ss.load(target, tmp_path / "c", **options)
        _assert_same_tree(target, before)
    target = {"w": torch.zeros(BIG), "obj": None, "t": (torch.zeros(BIG), (1, 2))}
    ss.load(target, tmp_path / "c", allow_pickle=True)
    assert target["obj"] == {1, 2} and torch.count_nonzero(target["w"]) > 0


def test_a_tuple_holding_a_subclass_of_the_stored_type_keeps_its_equal_value(tmp_path):
    """A numpy float64 (an lr drawn with numpy) is stored as the float it equals: a tuple that
    holds it loads (it was refused as '0.5 against np.float64(0.5)'); another value is refused."""
    np_value = np.float64(0.5)
    ss.save({"t": (torch.ones(BIG), np_value, 3)}, tmp_path / "c")
    target = {"t": (torch.zeros(BIG), np.float64(0.5), 3)}
    ss.load(target, tmp_path / "c")
    assert torch.equal(target["t"][0], torch.ones(BIG)) and target["t"][1:] == (0.5, 3)
    with pytest.raises(ss.StateMismatchError, match="t.1 lies in a tuple"):
        ss.load({"t": (torch.zeros(BIG), np.float64(0.25), 3)}, tmp_path / "c")


def test_a_list_stored_whole_beside_a_name_under_it_loads_whole(tmp_path):
    state = {"x": [1, 2], "x.0": torch.arange(3.0), "y": [torch.ones(2)], "y.1": 5}
    ss.save(state, tmp_path / "c")
    target = {"x": [0], "x.0": torch.zeros(3), "y": [torch.zeros(2)], "y.1": 0}
    ss.load(target, tmp_path / "c")
    assert target["x"] == [1, 2] and torch.equal(target["x.0"], torch.arange(3.0)) and target["y.1"] == 5
    assert torch.equal(target["y"][0], torch.ones(2))


def test_a_module_without_parameters_or_buffers_saves_and_loads(tmp_path):
    state = {"act": nn.ReLU(), "blocks": nn.Sequential(nn.ReLU(), nn.Dropout()), "x": torch.ones(2)}
    ss.save(state, tmp_path / "c")
    target = {"act": nn.ReLU(), "blocks": nn.Sequential(nn.ReLU(), nn.Dropout()), "x": torch.zeros(2)}
    ss.load(target, tmp_path / "c")
    assert torch.equal(target["x"], torch.ones(2))


def test_a_place_held_under_two_names_gets_each_name_its_stored_value(tmp_path):
    """A list, or a small tensor in a list, held under two names of the target (a fresh
    SequentialLR's ``_last_lr`` is its first scheduler's list), or a tensor that is both a data
    file's target and in a list: filling it for both names left the last value in both, without
    a word. The first is filled in place; the second name gets its stored value as a new object."""
    ss.save({"a": [0.5], "b": [0.25], "c": [torch.tensor([1, 2])], "d": [torch.tensor([3, 4])],
             "e": torch.ones(3), "f": [torch.zeros(3)]}, tmp_path / "c")
    shared, small, large = [0.0], torch.zeros(2, dtype=torch.int64), torch.full((3,), 7.0)
    state = {"a": shared, "b": shared, "c": [small], "d": [small], "e": large, "f": [large]}
    ss.load(state, tmp_path / "c")
    assert state["a"] == [0.5] and state["b"] == [0.25]
    assert state["c"][0].tolist() == [1, 2] and state["d"][0].tolist() == [3, 4]
    assert state["e"] is large and torch.equal(large, torch.ones(3)) and torch.equal(state["f"][0], torch.zeros(3))

    def scheduled(model):
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        warm = torch.optim.lr_scheduler.LinearLR(optim, 0.5, total_iters=3)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optim, 5)
        return optim, torch.optim.lr_scheduler.SequentialLR(optim, [warm, cosine], milestones=[3])
    optim, sched = scheduled(nn.Linear(2, 1))
    for _ in range(5):
        optim.step()
        sched.step()
    ss.save({"optim": optim, "sched": sched}, tmp_path / "seq")
    optim2, sched2 = scheduled(nn.Linear(2, 1))
    ss.load({"optim": optim2, "sched": sched2}, tmp_path / "seq")
    assert sched2.get_last_lr() == sched.get_last_lr() != [0.1] and sched2.state_dict() == sched.state_dict()


def test_a_held_bytearray_or_float_subclass_keeps_its_type(tmp_path):
    """A bytearray is filled in place (it came back as bytes, immutable); a value of a subclass of
    the stored type (numpy's float64 is a float, its str_ a str) stays one, holding the stored
    value bit for bit. A bool is not taken for an int."""
    ss.save({"buf": bytearray(b"ab"), "f": np.float64(0.1), "nan": float("-nan"), "s": "x", "i": 5}, tmp_path / "c")
    buf = bytearray(b"zz")
    state = {"buf": buf, "f": np.float64(0.0), "nan": np.float64(1.0), "s": np.str_("q"), "i": True}
    ss.load(state, tmp_path / "c")
    assert state["buf"] is buf and buf == b"ab"
    assert type(state["f"]) is np.float64 and state["f"] == 0.1
    assert type(state["nan"]) is np.float64 and struct.pack("<d", state["nan"]) == struct.pack("<d", float("-nan"))
    assert type(state["s"]) is np.str_ and state["s"] == "x"
    assert type(state["i"]) is int and state["i"] == 5


def test_plain_data_nested_past_the_recursion_limit_is_refused_saying_so(tmp_path):
    """Python's recursion limit ended the save with "maximum recursion depth exceeded", naming
    neither the problem nor a remedy."""
    deep: object = {"a": 1}
    for _ in range(2000):
        deep = [deep]
    with pytest.raises(ss.CheckpointError,
                       match="nests lists, tuples and dicts too deeply .* to be saved from .* calls deep.*: store"):
        ss.save({"deep": deep, "t": torch.ones(2)}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def _nested(levels: int):
    value: object = 1.5
    for level in range(levels):  # tuples, lists and dicts of keys JSON lacks, in turn
        value = ((value,), [value], {level: value})[level % 3]
    return value


def _at_stack_depth(frames: int, call):
    return call() if frames == 0 else _at_stack_depth(frames - 1, call)


def test_plain_data_as_deep_as_a_save_takes_loads_from_however_deep_a_caller_is(tmp_path, monkeypatch):
    """A save took whatever Python's recursion limit let it (a tuple 330 deep), and a load from
    60 frames down could not read it back: the intact checkpoint was called damaged, and
    ``load_latest`` restored an older step in its place. Now a save takes 100 levels at most,
    and reading a value does not depend on the caller's depth."""
    with pytest.raises(ss.UnsafeCheckpointError, match=r"v: it nests lists, tuples and dicts more than 100 levels"):
        ss.save({"v": _nested(101)}, tmp_path / "refused")
    ckpt = ss.Checkpointer(tmp_path / "root")
    ckpt.save(1, {"v": 1, "t": torch.zeros(2)}).wait()
    ckpt.save(2, {"v": _nested(100), "t": torch.ones(2)}).wait()
    ckpt.close()
    for frames in (0, 300, 800):
        state = {"v": None, "t": torch.zeros(2)}
        with ss.Checkpointer(tmp_path / "root") as again:
            assert _at_stack_depth(frames, lambda: again.load_latest(state)) == 2
        assert state["v"] == _nested(100) and torch.equal(state["t"], torch.ones(2))
    # what an older statesnap wrote (it took more levels) reads from deep down too
    monkeypatch.setattr(plaindata, "MAX_NESTING", 250)
    ss.save({"v": _nested(250)}, tmp_path / "older")
    state = {"v": None}
    _at_stack_depth(700, lambda: ss.load(state, tmp_path / "older"))
    assert state["v"] == _nested(250)
    assert _at_stack_depth(700, lambda: ss.open(tmp_path / "older").read("v")) == _nested(250)


Pair = collections.namedtuple("Pair", "n name")


def test_values_in_a_tuple_are_filled_in_place_or_must_be_the_stored_ones(tmp_path):
    model = nn.Linear(2, 2)
    state = {"pair": (model, [torch.get_rng_state()], float("nan"), (1, "a"))}
    ss.save(state, tmp_path / "c")
    ss.load(state, tmp_path / "c")  # the very state saved: every value is already the stored one
    rng = [torch.zeros(0, dtype=torch.uint8)]
    target = {"pair": (nn.Linear(2, 2), rng, float("nan"), Pair(1, "a"))}
    ss.load(target, tmp_path / "c")
    assert torch.equal(target["pair"][1][0], state["pair"][1][0]) and target["pair"][1] is rng
    assert torch.equal(target["pair"][0].weight, model.weight)


@pytest.mark.parametrize("key", ["", "x"])
def test_a_walked_sequence_under_a_top_level_empty_key_loads(tmp_path, key):
    """Under the top-level key "" the elements are named "0", "1", ...: the load looked for names
    under "." and refused every checkpoint of such a state."""
    weight = nn.Parameter(torch.randn(3))
    ss.save({key: (weight, 2.5), "rest": 1}, tmp_path / "c")
    target = {key: (nn.Parameter(torch.zeros(3)), 2.5), "rest": None}
    ss.load(target, tmp_path / "c")
    assert torch.equal(target[key][0], weight) and target["rest"] == 1


def test_a_tuple_keeps_no_float_that_differs_from_the_stored_one_in_its_bits(tmp_path):
    """Values in a tuple must be the stored ones; floats were compared with ==, so a tuple
    holding 0.0 took a checkpoint storing -0.0 (or another NaN) and kept its own value."""
    ss.save({"pair": (nn.Linear(2, 2), -0.0)}, tmp_path / "c")
    with pytest.raises(ss.CheckpointError, match=r"pair.1 lies in a tuple.*-0.0 against 0.0"):
        ss.load({"pair": (nn.Linear(2, 2), 0.0)}, tmp_path / "c")
    ss.load({"pair": (nn.Linear(2, 2), -0.0)}, tmp_path / "c")
    # A stored "nan" is math.nan's bits; writers before "nan:<bits>" wrote every NaN so, and
    # the NaN a tuple holds (inf - inf is -nan on x86) must still take their checkpoints.
    ss.save({"pair": (nn.Linear(2, 2), float("nan"))}, tmp_path / "old")
    ss.load({"pair": (nn.Linear(2, 2), float("inf") - float("inf"))}, tmp_path / "old")
    # NaNs of other bits are told apart in the message too, where both would print "nan"
    negative_nan = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000000))[0]
    ss.save({"pair": (nn.Linear(2, 2), negative_nan)}, tmp_path / "signed")
    with pytest.raises(ss.CheckpointError, match=r"pair.1 lies in a tuple.*nan:fff8000000000000 against "
                                                 r"nan:7ff8000000000000"):
        ss.load({"pair": (nn.Linear(2, 2), float("nan"))}, tmp_path / "signed")


def test_a_tuple_keeps_no_small_tensor_of_another_dtype_than_the_stored_one(tmp_path):
    """The same for a small tensor in a tuple stored whole: == of one-element tensors of two
    dtypes is True, so a float32 1.0 stayed where the checkpoint holds a float64 1.0."""
    ss.save({"pair": (nn.Linear(2, 2), (torch.tensor(1.0, dtype=torch.float64), 1))}, tmp_path / "c")
    with pytest.raises(ss.StateMismatchError, match=r"pair.1.0 \(checkpoint float64\[\], target float32\[\]\)"):
        ss.load({"pair": (nn.Linear(2, 2), (torch.tensor(1.0), 1))}, tmp_path / "c")
    target = {"pair": (nn.Linear(2, 2), (torch.tensor(0.0, dtype=torch.float64), 1))}
    ss.load(target, tmp_path / "c")  # the same dtype: filled in place
    assert target["pair"][1][0].item() == 1.0


def test_a_list_of_large_tensors_against_a_checkpoint_that_stored_it_whole_is_a_mismatch(tmp_path):
    ss.save({"y": [torch.arange(4.0), torch.arange(5.0)]}, tmp_path / "c")  # small: stored whole
    target = {"y": [torch.zeros(BIG), torch.zeros(BIG)]}
    with pytest.raises(ss.StateMismatchError):
        ss.load(target, tmp_path / "c")
    assert target["y"][0].numel() == BIG


def test_a_sequence_pickled_whole_before_such_sequences_were_walked_still_loads_whole(tmp_path, monkeypatch):
    from statesnap.state import flatten

    value = (torch.arange(float(BIG)), 5)
    with monkeypatch.context() as patch:
        patch.setattr(flatten, "_needs_walk", lambda value: False)  # as statesnap saved tuples before
        ss.save({"t": value}, tmp_path / "c", allow_pickle=True)
    assert ss.open(tmp_path / "c", allow_pickle=True).keys() == ["t"]
    target = {"t": (torch.zeros(BIG), 0)}
    ss.load(target, tmp_path / "c", allow_pickle=True)
    assert target["t"][1] == 5 and torch.equal(target["t"][0], value[0])


def test_fsspec_memory_url_round_trip():
    url = "memory://statesnap-tests/run/step-3"
    model, optim, sched = make_training()
    train(model, optim, sched, range(2))
    ss.save({"model": model, "optim": optim, "extra": {"step": 3}}, url, overwrite=True)
    model2, optim2, _ = make_training(seed=3)
    extra = {"step": 0}
    ss.load({"model": model2, "optim": optim2, "extra": extra}, url)
    assert_same_params(model, model2)
    assert_same_optim(optim, optim2)
    assert extra["step"] == 3
    reader = ss.open(url)
    assert torch.equal(reader.read("model.0.weight"), model.state_dict()["0.weight"])
    assert torch.equal(reader.read("model.0.weight", (slice(2, 5), 3)), model.state_dict()["0.weight"][2:5, 3])
    assert reader.verify() > 0
    with pytest.raises(ss.CheckpointExistsError):
        ss.save({"extra": {"step": 4}}, url)

    # Overwrite: the new manifest is the commit; the old data files go only after it.
    fs = fsspec.filesystem("memory")
    old_files = set(reader.manifest.files)
    ss.save({"extra": {"step": 4}, "t": torch.ones(2)}, url, overwrite=True)
    new = ss.open(url)
    assert new.read("extra.step") == 4 and torch.equal(new.read("t"), torch.ones(2))
    remaining = {p.rsplit("/", 1)[-1] for p in fs.ls(url, detail=False)}
    assert remaining == {*new.manifest.files, "manifest.json"} and not remaining & old_files


def _dtensor_replicate(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = torch.randn(64, 32)
    weight = distribute_tensor(full, mesh, [Replicate()])
    ss.save({"w": weight, "bias": torch.arange(16.0)}, path)
    target = distribute_tensor(torch.zeros(64, 32), mesh, [Replicate()])
    bias = torch.zeros(16)
    ss.load({"w": target, "bias": bias}, path)
    return torch.equal(target.to_local(), full) and torch.equal(bias, torch.arange(16.0))


def test_dtensor_replicate_written_once_over_two_ranks(tmp_path):
    path = str(tmp_path / "c")
    assert run_ranks(2, _dtensor_replicate, path) == [True, True]
    reader = ss.open(path)
    assert reader.info("w").pieces == 1 and reader.info("w").nbytes == 64 * 32 * 4
    assert reader.manifest.total_bytes < (64 * 32 + 16) * 4 + 2 * 64


def test_shm_scheme_saves_into_node_shared_memory():
    """``shm://NAME`` is a checkpoint level in /dev/shm: it outlives the process, loads like any other."""
    import os
    import shutil
    import uuid

    name = f"statesnap-test-{uuid.uuid4().hex[:8]}"
    state = {"w": torch.arange(12.0).reshape(3, 4), "extra": {"step": 7}}
    try:
        ss.save(state, f"shm://{name}/step-7")
        assert os.path.exists(f"/dev/shm/{name}/step-7/manifest.json")
        target = {"w": torch.zeros(3, 4), "extra": {"step": 0}}
        ss.load(target, f"shm://{name}/step-7")
        assert torch.equal(target["w"], state["w"]) and target["extra"]["step"] == 7
        assert ss.open(f"shm://{name}/step-7").verify() > 0
    finally:
        shutil.rmtree(f"/dev/shm/{name}", ignore_errors=True)


@pytest.mark.parametrize("name", ["", "/", ".", "..", "run/../..", "to tmp_path"])
def test_an_shm_name_that_leaves_no_directory_below_dev_shm_is_refused(tmp_path, name):
    """``shm://NAME`` promises memory: ``..`` put a root on the disk, and an empty name made
    /dev/shm itself a Checkpointer's root (its clean-up and retention among other programs'
    files). Nothing is written or claimed."""
    if name == "to tmp_path":
        name = os.path.relpath(tmp_path / "escaped", "/dev/shm")
    with pytest.raises(ss.CheckpointError, match="names no directory below /dev/shm"):
        ss.save({"w": torch.ones(2)}, f"shm://{name}")
    with pytest.raises(ss.CheckpointError, match="names no directory below /dev/shm"):
        ss.Checkpointer(tmp_path / "root", local_root=f"shm://{name}")
    assert not os.listdir(tmp_path) and not os.path.exists("/dev/shm/.statesnap-lock")


@pytest.mark.parametrize("saver", ["save", "checkpointer"])
def test_empty_tensors_neither_pad_nor_lengthen_the_data_file(tmp_path, saver):
    """docs/format.md §1: a file's size is exactly the size the manifest records. An empty tensor
    planned last used to be placed past the last byte, and the manifest recorded that offset as
    the file's size."""
    import json

    state = {"a_first_empty": torch.empty(0), "b": torch.arange(3, dtype=torch.uint8),
             "c_middle_empty": torch.empty(0, 4), "d": torch.arange(5, dtype=torch.int16),
             "z_last_empty": torch.empty(0, dtype=torch.bfloat16)}
    if saver == "save":
        path = tmp_path / "c"
        ss.save(state, path)
    else:
        with ss.Checkpointer(tmp_path / "root") as ckpt:
            ckpt.save(1, state).wait()
        path = next(p for p in (tmp_path / "root").iterdir() if (p / "manifest.json").exists())
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["file_sizes"] == [os.path.getsize(path / name) for name in manifest["files"]]
    assert manifest["file_sizes"] == [3 + 61 + 10]  # b, the gap up to 64, d
    loaded = {key: torch.ones_like(value) for key, value in state.items()}
    ss.load(loaded, path)
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


def test_small_tensors_inside_plain_values_are_loaded_in_place(tmp_path):
    """Small tensors in lists, dicts of lists and tuples are stored inline with plain data; a
    load used to put new tensor objects (and a new list) in their place, so whoever else held
    them (an optimizer over a list of plain tensors) kept the old values. They are filled in
    place now; a new element, or a value where an empty tensor holds the place, is put there."""
    saved = {"l": [torch.arange(3.), 7, [torch.ones(2, dtype=torch.int64)]], "t": (torch.full((2,), 5.),),
             "d": {"grown": [torch.arange(2.)], "other": [torch.arange(4.)]}}
    ss.save(saved, tmp_path / "c")
    held_list, held = [torch.zeros(3), 0, [torch.zeros(2, dtype=torch.int64)]], torch.zeros(3)
    held_list[0] = held
    inner, in_tuple, placeholder = held_list[2], torch.zeros(2), torch.empty(0, dtype=torch.float64)
    target = {"l": held_list, "t": (in_tuple,), "d": {"grown": [], "other": [placeholder]}}
    ss.load(target, tmp_path / "c")
    assert target["l"] is held_list and held_list[0] is held and held_list[2] is inner
    assert torch.equal(held, torch.arange(3.)) and held_list[1] == 7 and torch.equal(inner[0], torch.ones(2, dtype=torch.int64))
    assert torch.equal(in_tuple, torch.full((2,), 5.))
    assert torch.equal(target["d"]["grown"][0], torch.arange(2.))
    other = target["d"]["other"][0]
    assert other is not placeholder and other.dtype == torch.float32 and torch.equal(other, torch.arange(4.))


def test_a_small_tensor_held_in_a_list_that_the_stored_one_does_not_fit_is_a_mismatch(tmp_path):
    """An optimizer over a list of small tensors trains the list's tensors: one of another dtype
    or shape than the stored one was replaced in the list without a word, and the optimizer went
    on training the old one. Now it is a mismatch like any tensor's: refused (naming each, by its
    place), left as it was with strict=False (warned of, in LoadInfo.mismatched), converted in
    place with cast=True where both are floating."""
    params = [torch.full((4,), 1.5, requires_grad=True), torch.full((3,), -2.0, requires_grad=True)]
    ss.save({"params": params, "opt": torch.optim.SGD(params, lr=0.1), "extra": {"ids": [torch.arange(2)]}},
            tmp_path / "c")

    def target(first_dtype=torch.bfloat16, second=5, ids=torch.zeros(2)):
        new = [torch.zeros(4, dtype=first_dtype, requires_grad=True), torch.zeros(second, requires_grad=True)]
        return {"params": new, "opt": torch.optim.SGD(new, lr=0.1), "extra": {"ids": [ids]}}

    state = target()
    with pytest.raises(ss.StateMismatchError) as caught:
        ss.load(state, tmp_path / "c")
    message = str(caught.value)
    assert "params.0 (checkpoint float32[4], target bfloat16[4])" in message
    assert "params.1 (checkpoint float32[3], target float32[5])" in message
    assert "extra.ids.0 (checkpoint int64[2], target float32[2])" in message and "cast=True" in message
    assert all(float(t.detach().abs().sum()) == 0 for t in state["params"])  # nothing written

    state = target()
    held = list(state["params"])
    with pytest.warns(UserWarning, match=r"strict=False left .*params.0 \(checkpoint float32"):
        info = ss.load(state, tmp_path / "c", strict=False)
    assert sorted(info.mismatched) == ["extra.ids.0", "params.0", "params.1"]
    assert all(a is b and float(a.detach().abs().sum()) == 0 for a, b in zip(state["params"], held))

    state = target(second=3, ids=torch.zeros(2, dtype=torch.int64))
    held = list(state["params"]) + [state["extra"]["ids"][0]]
    ss.load(state, tmp_path / "c", cast=True)
    assert [a is b for a, b in zip(state["params"] + state["extra"]["ids"], held)] == [True] * 3
    first = state["params"][0]
    assert first.dtype == torch.bfloat16 and torch.equal(first, torch.full((4,), 1.5, dtype=torch.bfloat16))
    assert torch.equal(state["opt"].param_groups[0]["params"][1], torch.full((3,), -2.0))
    assert torch.equal(state["extra"]["ids"][0], torch.arange(2))


Tagged = collections.namedtuple("Tagged", "weights tags")  # (pickled by reference: at module level)


def test_values_an_owner_puts_back_are_not_fitted_and_pickled_ones_are_refused_before_any_is_put(tmp_path):
    """What an optimizer's or scheduler's own load_state_dict puts back takes the stored value, as
    torch's does: an lr saved as a float loads into an optimizer whose lr is a tensor now (the form
    torch.compile'd optimizers want). A pickled namedtuple holding a tensor loads as it was; a
    pickled list whose small tensor the stored one does not fit is refused before any plain value
    is put in place."""
    weight = torch.nn.Parameter(torch.zeros(2))
    optim = torch.optim.SGD([weight], lr=0.005)
    scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=1)
    ss.save({"opt": optim, "sched": scheduler}, tmp_path / "float_lr")
    weight = torch.nn.Parameter(torch.zeros(2))
    optim = torch.optim.SGD([weight], lr=torch.tensor(0.01))
    scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=1)
    ss.load({"opt": optim, "sched": scheduler}, tmp_path / "float_lr")
    assert optim.param_groups[0]["lr"] == 0.005 and scheduler.base_lrs == [0.005]

    ss.save({"x": Tagged(torch.arange(3.0), {"a", "b"})}, tmp_path / "pickled", allow_pickle=True)
    target = {"x": Tagged(torch.zeros(3), {"c"})}
    ss.load(target, tmp_path / "pickled", allow_pickle=True)
    assert torch.equal(target["x"].weights, torch.arange(3.0)) and target["x"].tags == {"a", "b"}

    ss.save({"n": 7, "extra": [{"a"}, torch.arange(3.0)]}, tmp_path / "unfit", allow_pickle=True)
    target = {"n": 0, "extra": [set(), torch.zeros(3, dtype=torch.float64)]}
    with pytest.raises(ss.StateMismatchError, match=r"extra.1 \(checkpoint float32\[3\], target float64\[3\]\)"):
        ss.load(target, tmp_path / "unfit", allow_pickle=True)
    assert target["n"] == 0 and target["extra"][0] == set()


def test_a_list_holding_one_tensor_several_times_loads_every_stored_value(tmp_path):
    """``[t] * 3`` as the target of three stored values: filling ``t`` in place three times
    left every element the last value. The first is filled, the others replaced."""
    ss.save({"window": [torch.full((2,), float(i)) for i in range(3)]}, tmp_path / "c")
    shared = torch.zeros(2)
    target = {"window": [shared] * 3}
    ss.load(target, tmp_path / "c")
    assert [v.tolist() for v in target["window"]] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    assert target["window"][0] is shared


def test_an_optimizer_over_a_wrapped_sequential_loads(tmp_path):
    """``torch.compile``'s wrapper names the parameters ``_orig_mod.0.weight``, PyTorch's helper
    stores them as ``0.weight``: the check for checkpoints kept by position must look for the
    helper's names too, or it takes such a checkpoint for one by position and refuses it."""
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        wrapped = torch.compile(model)  # (compiles nothing until called)
        return model, wrapped, torch.optim.Adam(wrapped.parameters(), lr=0.1)

    model, wrapped, optim = make()
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    ss.save({"model": wrapped, "optim": optim}, tmp_path / "c")
    assert "optim.state.0.weight.exp_avg" in ss.open(tmp_path / "c").keys()
    model2, wrapped2, optim2 = make()
    ss.load({"model": wrapped2, "optim": optim2}, tmp_path / "c")
    assert_same_optim(optim, optim2)


def test_names_holding_a_lone_surrogate_save_and_load(tmp_path):
    """A key from ``os.fsdecode`` of a file name that is not UTF-8 holds a lone surrogate; the
    save failed with a bare UnicodeEncodeError from the planner (which hashes names), not a
    CheckpointError. Such names save, load and read back as they are."""
    name = os.fsdecode(b"shard-\xff")
    ss.save({"files": {name: torch.arange(3.0), "n": {name: 7}}}, tmp_path / "c")
    assert ss.open(tmp_path / "c").keys() == sorted([f"files.{name}", f"files.n.{name}"])
    target = {"files": {name: torch.zeros(3), "n": {name: 0}}}
    ss.load(target, tmp_path / "c")
    assert torch.equal(target["files"][name], torch.arange(3.0)) and target["files"]["n"][name] == 7
    info = ss.export(tmp_path / "c", tmp_path / "c.safetensors")  # (a safetensors header is UTF-8)
    assert sorted(info.skipped) == [f"files.n.{name} (safetensors holds tensors only)",
                            f"files.{name} (safetensors names are UTF-8; this one holds a lone surrogate)"]


def test_file_urls_name_the_local_paths_they_name(tmp_path, monkeypatch):
    """Only file:///p was understood: file://localhost/p and file:/p (RFC 8089 spells the same
    path so) became the relative paths localhost/p and file:/p, so the checkpoint went into the
    working directory, where no load from elsewhere finds it. A file URL of another host is
    refused rather than written here."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    for url, name in ((f"file://localhost{tmp_path}/a", "a"), (f"file:{tmp_path}/b", "b")):
        ss.save({"x": torch.ones(2)}, url)
        assert torch.equal(ss.open(tmp_path / name).read("x"), torch.ones(2))
    assert os.listdir(tmp_path / "cwd") == []
    with pytest.raises(ss.CheckpointError, match="names a file on the host 'server'"):
        ss.save({"x": torch.ones(2)}, "file://server/share/c")
    ss.save({"x": torch.ones(2)}, f"file://LOCALHOST{tmp_path}/c")  # (host names ignore case)
    assert torch.equal(ss.open(tmp_path / "c").read("x"), torch.ones(2))
    for url in ("file://", "file://localhost", "file:///"):
        with pytest.raises(ss.CheckpointError, match="names no path"):
            ss.save({"x": torch.ones(2)}, url)


class _Counter:
    """Something with state_dict/load_state_dict whose state dict is not a dict."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return self.value

    def load_state_dict(self, sd):
        self.value = sd


@pytest.mark.parametrize("value", [[1, 2], torch.ones(2), 5])
def test_a_state_dict_that_is_no_dict_is_refused_by_name(tmp_path, value):
    """It failed with "preparing the save failed on rank 0: 'list' object has no attribute
    'items'", naming neither the value nor what to do."""
    with pytest.raises(ss.CheckpointError, match=r"sampler: state_dict\(\) of the _Counter returned a "):
        ss.save({"sampler": _Counter(value)}, tmp_path / "c")


def test_a_state_dict_that_is_a_mapping_saves_and_loads(tmp_path):
    """A ``state_dict()`` returning a Mapping other than a dict (a UserDict) is walked like one."""
    import collections

    ss.save({"sampler": _Counter(collections.UserDict(pos=torch.arange(3), epoch=2))}, tmp_path / "c")
    target = _Counter(collections.UserDict(pos=torch.zeros(3, dtype=torch.int64), epoch=0))
    ss.load({"sampler": target}, tmp_path / "c")
    assert target.value["pos"].tolist() == [0, 1, 2] and target.value["epoch"] == 2


class _Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


_Pair = collections.namedtuple("_Pair", "first second")


def test_a_load_gives_enum_members_and_namedtuples_back_as_the_held_class(tmp_path):
    """Plain data stores an ``IntEnum`` member as its value and a namedtuple as a tuple. Loaded
    into a state holding one, the value came back as a plain int (``state["level"].name`` then
    failed) and a changed namedtuple as a plain tuple. They come back in the held class."""
    ss.save({"level": _Level.HIGH, "pair": _Pair(1, 2.5), "t": torch.ones(2)}, tmp_path / "c")
    state = {"level": _Level.LOW, "pair": _Pair(0, 0.0), "t": torch.zeros(2)}
    ss.load(state, tmp_path / "c")
    assert state["level"] is _Level.HIGH and type(state["pair"]) is _Pair and state["pair"] == (1, 2.5)
    ss.save({"level": 7, "t": torch.ones(2)}, tmp_path / "other")  # no member of that value: the value
    other = {"level": _Level.LOW, "t": torch.zeros(2)}
    ss.load(other, tmp_path / "other")
    assert other["level"] == 7 and type(other["level"]) is int


def test_a_torch_size_comes_back_a_torch_size(tmp_path):
    """Plain data stores a ``torch.Size`` as a tuple; loaded into a state holding one, it came
    back a tuple (``.numel()`` then failed), from storage and from host memory alike."""
    ss.save({"shape": torch.Size([3, 224, 224]), "t": torch.ones(2)}, tmp_path / "c")
    state = {"shape": torch.Size([1]), "t": torch.zeros(2)}
    ss.load(state, tmp_path / "c")
    assert type(state["shape"]) is torch.Size and state["shape"].numel() == 3 * 224 * 224
    with ss.Checkpointer(tmp_path / "root", persist_every=1) as ckpt:
        ckpt.save(1, {"shape": torch.Size([2, 5])}).wait()
        state = {"shape": torch.Size([9])}
        assert ckpt.load_latest(state) == 1 and ckpt.loaded_from == "memory"
    assert type(state["shape"]) is torch.Size and state["shape"] == (2, 5)


class _Registry(dict):
    """A dict that keeps more state than its items, saved through its state_dict."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.version = 0

    def state_dict(self):
        return {"entries": dict(self), "version": self.version}

    def load_state_dict(self, sd):
        self.clear()
        self.update(sd["entries"])
        self.version = sd["version"]


def test_a_dict_with_a_state_dict_is_saved_through_it(tmp_path):
    """A dict subclass with ``state_dict``/``load_state_dict`` was walked as a plain dict: what it
    keeps outside its items (a version) was lost, and its ``load_state_dict`` never ran."""
    registry = _Registry(a=1)
    registry.version = 7
    ss.save({"reg": registry}, tmp_path / "c")
    assert sorted(ss.open(tmp_path / "c").keys()) == ["reg.entries.a", "reg.version"]
    fresh = _Registry(a=0)
    ss.load({"reg": fresh}, tmp_path / "c")
    assert fresh == {"a": 1} and fresh.version == 7
    ss.save({"reg": {"a": 5}}, tmp_path / "items")  # as statesnap stored such a dict before: by its items
    older = _Registry(a=0)
    ss.load({"reg": older}, tmp_path / "items")
    assert older == {"a": 5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex32])
def test_one_element_views_with_a_stride_save_and_load(tmp_path, dtype):
    """``w[:, 0]`` of a (1, n) weight has one element and stride n, which PyTorch counts as
    contiguous, so ``contiguous()`` kept the stride and the byte view refused it: saves failed
    (in a list: a raw error naming no tensor) and loads into such a view failed too."""
    weight = torch.randn(1, 8).to(dtype)
    state = {"w": weight, "column": weight[:, 0], "in_list": [weight[:, 1], 3]}
    ss.save(state, tmp_path / "c")
    target_weight = torch.zeros(1, 8, dtype=dtype)
    target = {"w": target_weight, "column": target_weight[:, 0], "in_list": [torch.zeros(1, dtype=dtype), 0]}
    ss.load(target, tmp_path / "c")
    wide = torch.complex64 if dtype.is_complex else torch.float64  # (holds every value exactly)
    assert torch.equal(target_weight.to(wide), weight.to(wide))
    assert torch.equal(target["in_list"][0].to(wide), weight[:, 1].to(wide))


def test_plain_values_the_format_cannot_spell_are_refused_by_name(tmp_path):
    with pytest.raises(ss.UnsafeCheckpointError, match=r"extra\.cfg\.dtype: torch\.quint8 is a dtype"):
        ss.save({"extra": {"cfg": {"dtype": torch.quint8}}}, tmp_path / "a")
    with pytest.raises(ss.CheckpointError, match=r"extra\.m: a key of \d+ bits is too long"):
        ss.save({"extra": {"m": {10 ** 5000: torch.ones(2)}}}, tmp_path / "b")
    with pytest.raises(ss.UnsafeCheckpointError, match=r"r: a tensor of 1,200,000 bytes is more than plain data"):
        ss.save({"r": ss.PerRank(torch.ones(300_000))}, tmp_path / "c")
    assert ss.save({"extra": {"cfg": {"dtype": torch.quint8}}}, tmp_path / "d", allow_pickle=True)



def test_a_load_moves_its_targets_version_counters_before_it_writes(tmp_path, monkeypatch):
    """The counters moved only after the whole load: a Checkpointer's snapshot of the same tensors
    still being copied, which looks at them after each copy and before it commits, could commit
    while the load was writing, a mix of both states without an error."""
    load_module = importlib.import_module("statesnap.engine.load")
    model = nn.Linear(4, 4)
    ss.save({"model": model}, tmp_path / "c")
    before = {name: t._version for name, t in model.state_dict(keep_vars=True).items()}
    seen = {}
    read_into = load_module._read_into

    def watched(wanted, *args, **kwargs):
        seen.update({item.fqn: item.local._version for item in wanted})
        return read_into(wanted, *args, **kwargs)
    monkeypatch.setattr(load_module, "_read_into", watched)
    ss.load({"model": model}, tmp_path / "c")
    assert seen and all(seen[f"model.{name}"] > version for name, version in before.items())
    assert all(t._version > seen[f"model.{name}"] for name, t in model.state_dict(keep_vars=True).items())


class _AttributeDict(dict):
    """The config idiom: attributes are its items (a missing one is a KeyError, not an AttributeError)."""

    __getattr__ = dict.__getitem__
    __setattr__ = dict.__setitem__


def test_an_attribute_dict_is_saved_as_the_dict_it_is(tmp_path):
    config = _AttributeDict(lr=0.1, layers=4)
    ss.save({"cfg": config, "t": torch.ones(2)}, tmp_path / "c")
    target = {"cfg": _AttributeDict(lr=0.0, layers=0), "t": torch.zeros(2)}
    ss.load(target, tmp_path / "c")
    assert target["cfg"] == {"lr": 0.1, "layers": 4}
