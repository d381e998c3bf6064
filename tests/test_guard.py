"""Writers that no torch optimizer hook sees: optimizer-like wrappers and ``ckpt.guard``.

DeepSpeed's and Megatron's optimizers, EMA updates and hand-written steps change tensors through
``.data``, which bumps no version counter: unless something holds them back until the snapshot
copy is done, the checkpoint silently holds the values after the change.
"""
import copy
import logging
import pickle
import threading
import time
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

import statesnap as ss
from statesnap.checkpointer import hooks, pipeline
from test_checkpointer import Gate, assert_checkpoint_equals, make_training, reference


class CopiesWaitForAWaiter:
    """Holds every staging copy until something waits for a snapshot (a guard, a step hook,
    ``wait_staged``). So a writer that does not wait runs before the copy, every time, and one
    that waits is what lets the copy run: no timing decides the outcome."""

    def __init__(self, monkeypatch):
        self.opened = threading.Event()
        real_copy, real_wait = pipeline.copy_into, hooks.Countdown.wait

        def gated_copy(*args, **kwargs):
            self.opened.wait()
            real_copy(*args, **kwargs)

        def opening_wait(countdown, timeout=None):
            self.opened.set()
            return real_wait(countdown, timeout)
        monkeypatch.setattr(pipeline, "copy_into", gated_copy)
        monkeypatch.setattr(hooks.Countdown, "wait", opening_wait)

    def open(self):
        self.opened.set()


class DataSGD:
    """An optimizer wrapper as DeepSpeed and apex write them: not a ``torch.optim.Optimizer``
    (so no pre-step hook), with ``param_groups``, stepping through ``.data``."""

    def __init__(self, params, lr=0.1):
        self.param_groups = [{"params": list(params), "lr": lr}]

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad, alpha=-group["lr"])

    def state_dict(self):
        return {"lr": self.param_groups[0]["lr"]}

    def load_state_dict(self, sd):
        self.param_groups[0]["lr"] = sd["lr"]


class MixedPrecisionWrapper:
    """Like DeepSpeed's ZeRO and Megatron's mixed-precision optimizers: an inner torch optimizer
    steps fp32 master copies, then ``step`` writes them into the bf16 model through ``.data``."""

    def __init__(self, model):
        self.params = list(model.parameters())
        self.master = [p.detach().float().clone() for p in self.params]
        self.optimizer = torch.optim.SGD(self.master, lr=0.1, momentum=0.9)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self):
        for p, m in zip(self.params, self.master):
            m.grad = p.grad.float()
        self.optimizer.step()
        for p, m in zip(self.params, self.master):
            p.data.copy_(m.data)

    def state_dict(self):
        return {"master": dict(enumerate(self.master))}

    def load_state_dict(self, sd):
        for m, value in zip(self.master, sd["master"].values()):
            m.copy_(value)


class EMA:
    """Exponential moving average of a model's weights, updated through ``.data``."""

    def __init__(self, model, decay=0.9):
        self.decay = decay
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters()}

    def update(self, model):
        for name, p in model.named_parameters():
            self.shadow[name].data.mul_(self.decay).add_(p.data, alpha=1 - self.decay)

    def state_dict(self):
        return dict(self.shadow)

    def load_state_dict(self, sd):
        for name, value in sd.items():
            self.shadow[name].copy_(value)


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Like accelerate's: a ``torch.optim.Optimizer`` subclass whose ``__init__`` never calls
    ``Optimizer.__init__`` (so it has no hook tables: ``register_step_pre_hook`` raises
    AttributeError), forwarding to the torch optimizer in ``.optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure=None):
        return self.optimizer.step(closure)


STEP, UPDATE = vars(DataSGD)["step"], vars(EMA)["update"]
ACC_STEP = vars(AcceleratedOptimizer)["step"]


def backward(model, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, model[0].in_features, generator=g).to(model[0].weight.dtype)
    model(x).float().pow(2).sum().backward()


def hook_waits(ckpt) -> int:
    return ckpt.stats()["phases"].get("wait-in-hook", {}).get("count", 0)


# eager_copy_mb=0 in the tests below: tensors no torch optimizer writes are then copied in the
# background, not inside save(), so nothing but the guard keeps the write away from the copy.

def test_an_optimizer_like_wrapper_in_the_state_waits_for_the_copy(tmp_path, monkeypatch):
    model, _ = make_training()
    optim = DataSGD(model.parameters())
    backward(model, 1)
    optim.step()
    state = {"model": model, "optim": optim}
    ref = reference(state)
    gate = CopiesWaitForAWaiter(monkeypatch)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01, eager_copy_mb=0)
    handle = ckpt.save(1, state)
    backward(model, 2)
    assert not handle.staged.done()
    optim.step()  # without the guard it writes now, before any copy: the checkpoint gets its values
    gate.open()
    ckpt.close()
    assert_checkpoint_equals(handle.wait(), ref)
    assert not torch.equal(model[0].weight, ref["model.0.weight"])  # the step did run afterwards
    assert hook_waits(ckpt) == 1


def test_guard_holds_back_an_ema_update(tmp_path, monkeypatch):
    model, _ = make_training()
    ema = EMA(model)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model)
    state = {"model": model, "ema": ema}
    ref = reference(state)
    gate = CopiesWaitForAWaiter(monkeypatch)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01, eager_copy_mb=0)
    ckpt.guard(ema, "update")
    handle = ckpt.save(1, state)
    ema.update(model)  # changes the shadow weights: the EMA has not caught up with the +1 yet
    gate.open()
    ckpt.close()
    assert_checkpoint_equals(handle.wait(), ref)
    assert not torch.equal(ema.shadow["0.weight"], ref["ema.0.weight"])
    assert hook_waits(ckpt) == 1


def test_a_wrapper_around_a_torch_optimizer_also_in_the_state(tmp_path, monkeypatch):
    """The wrapper's step waits for the whole snapshot; the inner optimizer's hook then finds
    its copies done: one wait, no deadlock."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)).to(torch.bfloat16)
    optim = MixedPrecisionWrapper(model)
    backward(model, 1)
    optim.step()
    state = {"model": model, "optim": optim, "inner": optim.optimizer}
    ref = reference(state)
    gate = CopiesWaitForAWaiter(monkeypatch)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01, eager_copy_mb=0)
    handle = ckpt.save(1, state)
    backward(model, 2)
    stepper = threading.Thread(target=optim.step, daemon=True)
    stepper.start()
    stepper.join(60)
    gate.open()
    assert not stepper.is_alive(), "the wrapper's step deadlocked"
    ckpt.close()
    assert_checkpoint_equals(handle.wait(), ref)
    assert not torch.equal(model[0].weight, ref["model.0.weight"])
    assert hook_waits(ckpt) == 1


def test_close_puts_the_methods_back(tmp_path):
    model, _ = make_training()
    optim, ema = DataSGD(model.parameters()), EMA(model)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01)
    ckpt.guard(ema, "update")
    ckpt.save(1, {"model": model, "optim": optim, "ema": ema}).wait()
    assert DataSGD.step.__wrapped__ is STEP and EMA.update.__wrapped__ is UPDATE
    ckpt.close()
    assert vars(DataSGD)["step"] is STEP and vars(EMA)["update"] is UPDATE
    assert "step" not in vars(optim) and "update" not in vars(ema)
    backward(model, 1)
    optim.step()  # works without the Checkpointer
    ema.update(model)


def test_copies_of_a_guarded_object_act_on_themselves(tmp_path, monkeypatch):
    """The method is replaced on the class, and waits only for the guarded instance: a copy
    (deepcopy, pickle, a replica sharing its ``__dict__``) neither waits nor calls the original."""
    model, _ = make_training()
    ema = EMA(model)
    state = {"ema": ema}
    ref = reference(state)
    gate = CopiesWaitForAWaiter(monkeypatch)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01, eager_copy_mb=0)
    ckpt.guard(ema, "update")
    handle = ckpt.save(1, state)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    for twin in (copy.deepcopy(ema), pickle.loads(pickle.dumps(ema)), copy.copy(ema)):
        twin.shadow = {name: t.clone() for name, t in twin.shadow.items()}
        twin.update(model)  # the copy is changed, the original is not, and nothing waited
        assert not torch.equal(twin.shadow["0.weight"], ema.shadow["0.weight"])
    assert not gate.opened.is_set()
    gate.open()
    ckpt.close()
    assert_checkpoint_equals(handle.wait(), ref)
    assert hook_waits(ckpt) == 0


def test_two_checkpointers_guarding_one_object(tmp_path):
    model, _ = make_training()
    ema = EMA(model)
    first = ss.Checkpointer(tmp_path / "a", host_memory_gb=0.01)
    second = ss.Checkpointer(tmp_path / "b", host_memory_gb=0.01)
    first.guard(ema, "update")
    second.guard(ema, "update")
    first.close()  # the second still needs the class's method replaced
    assert EMA.update.__wrapped__ is UPDATE
    ema.update(model)
    second.close()
    assert vars(EMA)["update"] is UPDATE


def test_saving_again_does_not_wrap_twice(tmp_path):
    model, _ = make_training()
    optim, ema = DataSGD(model.parameters()), EMA(model)
    state = {"model": model, "optim": optim}
    with ss.Checkpointer(tmp_path, host_memory_gb=0.01) as ckpt:
        for step in (1, 2, 3):
            backward(model, step)
            optim.step()
            ckpt.guard(ema, "update")
            ckpt.save(step, state).wait()
        assert DataSGD.step.__wrapped__ is STEP and EMA.update.__wrapped__ is UPDATE
        for obj, name in ((optim, "step"), (ema, "update")):
            assert len(hooks._patches[(type(obj), name)].guards[id(obj)]) == 1


def test_guarded_objects_are_not_kept_alive(tmp_path):
    model, _ = make_training()
    optim, ema = DataSGD(model.parameters()), EMA(model)
    with ss.Checkpointer(tmp_path, host_memory_gb=0.01) as ckpt:
        ckpt.guard(ema, "update")
        ckpt.save(1, {"model": model, "optim": optim}).wait()
        refs = weakref.ref(optim), weakref.ref(ema)
        del optim, ema  # no reference cycle either: freed at once, without the garbage collector
        assert [r() for r in refs] == [None, None]


def test_what_cannot_be_guarded_is_a_checkpoint_error(tmp_path):
    class Slotted:  # an optimizer-like object that takes no weak references
        __slots__ = ("param_groups",)

        def __init__(self):
            self.param_groups = []

        def step(self):
            pass

        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            pass
    with ss.Checkpointer(tmp_path, host_memory_gb=0.01) as ckpt:
        with pytest.raises(ss.CheckpointError, match="no method"):
            ckpt.guard(EMA(make_training()[0]), "no method")
        with pytest.raises(ss.CheckpointError, match=r"Slotted\.step.*weak references"):
            ckpt.guard(Slotted(), "step")
        patched = DataSGD([])
        patched.step = lambda: None  # as an LR scheduler wraps a torch optimizer's step
        with pytest.raises(ss.CheckpointError, match="its own attribute 'step'"):
            ckpt.guard(patched, "step")
        with pytest.warns(RuntimeWarning, match=r"Slotted\.step.*wait_staged"):
            ckpt.save(1, {"t": torch.ones(3), "optim": Slotted()})


@pytest.mark.parametrize("eager_copy_mb", [64, 0])
def test_a_data_write_outside_any_guard(tmp_path, monkeypatch, eager_copy_mb):
    """The documented limit. A tensor no optimizer writes, unchanged since the last save, then
    changed through ``.data`` by code that no guard holds back: the eager copy inside ``save``
    keeps the checkpoint right; without it the version counter misses the write, and the
    checkpoint holds the new values with no error. (If this starts failing,
    docs/checkpointer.md promises too little.)"""
    state = {"ema": torch.zeros(1000)}
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01, eager_copy_mb=eager_copy_mb)
    ckpt.save(1, state).wait()  # (the first save waits for every copy of such tensors)
    gate = CopiesWaitForAWaiter(monkeypatch)
    handle = ckpt.save(2, state)
    state["ema"].data.add_(1.0)
    gate.open()
    ckpt.close()
    stored = ss.open(handle.wait()).read("ema")
    assert torch.equal(stored, torch.zeros(1000) if eager_copy_mb else torch.ones(1000))


@pytest.mark.parametrize("through", ["wrapper", "inner"])
def test_an_optimizer_subclass_that_takes_no_hooks(tmp_path, monkeypatch, through):
    """accelerate's AcceleratedOptimizer never runs Optimizer.__init__, so it takes no step hook:
    its step is guarded like a wrapper's, and the torch optimizer inside it gets the hook (what
    a GradScaler steps directly). A checkpoint taken before either step holds the values before it."""
    model, inner = make_training()
    optim = AcceleratedOptimizer(inner)
    with pytest.raises(AttributeError):
        optim.register_step_pre_hook(lambda *args: None)  # what Checkpointer.save used to call
    backward(model, 1)
    optim.step()
    state = {"model": model, "optim": optim}
    ref = reference(state)
    assert any(".exp_avg" in fqn for fqn in ref)
    gate = CopiesWaitForAWaiter(monkeypatch)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01, eager_copy_mb=0)
    handle = ckpt.save(1, state)
    assert AcceleratedOptimizer.step.__wrapped__ is ACC_STEP
    optim.zero_grad()
    backward(model, 2)
    assert not handle.staged.done()
    (optim if through == "wrapper" else inner).step()  # waits for the copies, which then run
    gate.open()
    ckpt.close()
    assert_checkpoint_equals(handle.wait(), ref)
    assert not torch.equal(model[0].weight, ref["model.0.weight"])  # the step did run afterwards
    assert hook_waits(ckpt) == 1
    assert vars(AcceleratedOptimizer)["step"] is ACC_STEP  # close put the method back


@pytest.mark.parametrize("passed", ["positional", "keyword"])
def test_a_closure_step_waits_after_its_closure_not_before(tmp_path, monkeypatch, passed):
    """``optimizer.step(closure)`` runs forward and backward inside the step (Lightning, LBFGS):
    the hook lets the closure run while the copy is held, and the update waits for the copy."""
    model, optim = make_training()
    backward(model, 1)
    optim.step()
    state = {"model": model, "optim": optim}
    ref = reference(state)
    gate = CopiesWaitForAWaiter(monkeypatch)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01)
    handle = ckpt.save(1, state)
    ran_before_the_copy = []

    def closure():
        optim.zero_grad()
        backward(model, 2)
        ran_before_the_copy.append(not handle.staged.done())
        return torch.tensor(0.0)
    optim.step(closure) if passed == "positional" else optim.step(closure=closure)
    ckpt.close()
    assert ran_before_the_copy == [True]
    assert_checkpoint_equals(handle.wait(), ref)
    assert not torch.equal(model[0].weight, ref["model.0.weight"])
    assert hook_waits(ckpt) == 1


def test_a_guarded_optimizer_owns_its_tensors_in_a_plain_state_dict(tmp_path, monkeypatch):
    """A framework hands over plain state dicts (Lightning's checkpoint dict): with the optimizer
    given to ``guard``, its parameters and moments are copied lazily and its step waits, while
    eager_copy_mb=0 puts nothing else in the way of the write."""
    model, optim = make_training()
    backward(model, 1)
    optim.step()
    gate = CopiesWaitForAWaiter(monkeypatch)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01, eager_copy_mb=0)
    ckpt.guard(optim)
    state = {"state_dict": model.state_dict(), "optimizer_states": {"0": optim.state_dict()["state"]}}
    ref = reference(state)
    handle = ckpt.save(1, state)
    backward(model, 2)
    optim.step()  # waits in its hook: the copy runs, then the update
    ckpt.close()
    assert_checkpoint_equals(handle.wait(), ref)
    assert not torch.equal(model[0].weight, ref["state_dict.0.weight"])
    assert hook_waits(ckpt) == 1


def test_optimizer_state_given_other_memory_before_its_copy_is_reported(tmp_path, monkeypatch):
    """``exp_avg.data = ...`` right after save(): the optimizer's state tensors are copied from
    whatever memory they hold when the copy runs, and the version counter does not move, so
    the checkpoint held the new values without a word. The copy now also compares where each
    tensor's values lie with where they lay at save(), and drops the checkpoint."""
    model = nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01)
    gate = CopiesWaitForAWaiter(monkeypatch)
    handle = ckpt.save(1, {"model": model, "optim": optim})
    exp_avg = optim.state[model.weight]["exp_avg"]
    exp_avg.data = exp_avg.data + 1
    gate.open()
    with pytest.raises(ss.ConsistencyError, match="tensor 'optim.state.weight.exp_avg' was given other memory"):
        handle.wait()
    ckpt.close()
    assert not (tmp_path / "step-1").exists()


@pytest.mark.parametrize("first", ["wait", "load_latest"])
def test_a_step_kept_in_memory_only_changed_in_place_after_save_is_not_restored(tmp_path, first, caplog):
    """A step not persisted had no commit to look at its version counters a last time, so a
    change in place right after save() that ended after its copy's own check went unseen:
    load_latest restored the changed values from host memory. ``wait()`` of such a step and
    the restore from memory now look at them (as a commit does)."""
    model = nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01, persist_every=10)
    handle = ckpt.save(1, {"model": model, "optim": optim})
    handle.staged.result(timeout=60)  # the copy and its check are done: the change comes later
    with torch.no_grad():
        model.weight.mul_(2)
    if first == "wait":
        with pytest.raises(ss.ConsistencyError, match="tensor 'model.weight' was changed in place after save"):
            handle.wait()
    fresh = nn.Linear(64, 64)
    before = fresh.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="statesnap"):
        assert ckpt.load_latest({"model": fresh, "optim": torch.optim.Adam(fresh.parameters(), lr=1e-2)}) is None
    assert "the snapshot of step 1 in host memory is not restored" in caplog.text
    assert ckpt.loaded_from is None and torch.equal(fresh.weight, before)
    ckpt.close()


def _saved_behind_a_gate(tmp_path, monkeypatch, state):
    """(the state's values now, the gate, the Checkpointer, the handle of its save of step 1)
    with every copy held until something waits for it (``CopiesWaitForAWaiter``)."""
    ref = reference(state)
    gate = CopiesWaitForAWaiter(monkeypatch)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01, eager_copy_mb=0)
    return ref, gate, ckpt, ckpt.save(1, state)


@pytest.mark.parametrize("held", ["list", "tuple", "dict in a list"])
def test_an_optimizer_held_in_a_list_is_hooked_as_one_in_a_dict(tmp_path, monkeypatch, held):
    """The flattening walks lists and tuples holding optimizers, so their state was saved, but
    the search for step hooks walked dicts only: the step did not wait for the copies of what it
    writes, and with a guarded method set the save trusted it not to change (torn checkpoints)."""
    model, optim = make_training()
    backward(model, 1)
    optim.step()
    optims = {"list": [optim], "tuple": (optim,), "dict in a list": [{"optim": optim}]}[held]
    ref, gate, ckpt, handle = _saved_behind_a_gate(tmp_path, monkeypatch, {"model": model, "optims": optims})
    backward(model, 2)
    optim.step()  # waits in its hook: the copy runs, then the update
    gate.open()
    ckpt.close()
    assert_checkpoint_equals(handle.wait(), ref)
    assert not torch.equal(model[0].weight, ref["model.0.weight"])
    assert hook_waits(ckpt) == 1


class _WarmupLR:
    """An LR scheduler of another library (DeepSpeed's ``WarmupLR`` is shaped so): ``step`` and an
    ``.optimizer``, no torch ``LRScheduler``."""

    def __init__(self, optimizer):
        self.optimizer, self.last_batch_iteration = optimizer, -1

    def step(self, last_batch_iteration=None):
        self.last_batch_iteration += 1
        for group in self.optimizer.param_groups:
            group["lr"] = 0.1 * min(1.0, (self.last_batch_iteration + 1) / 10)

    def get_lr(self):
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd):
        self.last_batch_iteration = sd["last_batch_iteration"]


class OptimizerParamScheduler:
    """Megatron-core's scheduler is shaped so: it counts in ``num_steps``."""

    def __init__(self, optimizer):
        self.optimizer, self.num_steps = optimizer, 0

    def step(self, increment=1):
        self.num_steps += increment


def test_another_library_s_lr_scheduler_is_no_optimizer_wrapper():
    """Taken for an optimizer wrapper, a scheduler made the save trust that only guarded methods
    change the tensors no optimizer writes: a buffer the forward changes (BatchNorm's statistics)
    was then copied while it changed, and committed torn."""
    model, optim = make_training()
    for scheduler in (_WarmupLR(optim), OptimizerParamScheduler(optim),
                      type("CosineLR", (), {"step": lambda self: None, "optimizer": optim})()):
        assert not hooks.is_optimizer_like(scheduler), type(scheduler).__name__
    assert hooks.find_writers({"optim": optim, "sched": _WarmupLR(optim)}) == ([optim], [])
    assert hooks.is_optimizer_like(DataSGD(model.parameters()))


class _SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as it is commonly written: its step moves the parameters,
    then calls the closure for the gradient there, then moves them back and steps."""

    def __init__(self, params, lr=0.1, rho=0.05):
        super().__init__(params, {"lr": lr, "rho": rho})

    @torch.no_grad()
    def step(self, closure):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["e"] = group["rho"] * p.grad / (p.grad.norm() + 1e-12)
                p.add_(self.state[p]["e"])
        with torch.enable_grad():
            closure()
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(self.state[p]["e"]).sub_(group["lr"] * p.grad)


def test_an_optimizer_that_changes_its_parameters_before_its_closure_waits_first(tmp_path, monkeypatch):
    """SAM's step changes the parameters before it calls the closure; the hook made only the
    closure's end wait (as for torch's optimizers, which call it first), so the copies ran
    after the change and most checkpoints failed, blaming 'something other than its optimizer'."""
    model, _ = make_training()
    optim = _SAM(model.parameters())
    backward(model, 1)
    optim.step(lambda: backward(model, 3))
    ref, gate, ckpt, handle = _saved_behind_a_gate(tmp_path, monkeypatch, {"model": model, "optim": optim})
    backward(model, 2)
    optim.step(lambda: backward(model, 4))
    gate.open()
    ckpt.close()
    assert_checkpoint_equals(handle.wait(), ref)
    assert hook_waits(ckpt) == 1


def test_a_step_of_no_module_is_hooked_as_another_library_s(tmp_path, monkeypatch):
    """A class made by exec() in a namespace without __name__: its step's __module__ is None, and
    the hook failed every step with AttributeError."""
    model, _ = make_training()
    namespace = {"torch": torch, "__builtins__": __builtins__}
    exec("class Stepped(torch.optim.SGD):\n    def step(self, closure=None):\n        return super().step(closure)",
         namespace)
    optim = namespace["Stepped"](model.parameters(), lr=0.1)
    assert type(optim).step.__module__ is None
    backward(model, 1)
    ref, gate, ckpt, handle = _saved_behind_a_gate(tmp_path, monkeypatch, {"model": model, "optim": optim})
    backward(model, 2)
    optim.step()
    gate.open()
    ckpt.close()
    assert_checkpoint_equals(handle.wait(), ref)


@pytest.mark.parametrize("fused", [True, False])
def test_an_optimizer_left_out_of_the_state_waits_for_the_copies_it_would_overwrite(tmp_path, monkeypatch, fused):
    """A weights-only Checkpointer: the optimizer is not in the state, and a fused step moves no
    version counter, so neither save() nor the check after the copy saw it change the weights:
    the checkpoints held values of after save(), silently. Every torch optimizer's step now waits
    where it would write what a snapshot in flight still copies."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    optim = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused, foreach=None if fused else True)
    other = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)  # writes nothing the snapshot holds
    state = {"model": model}
    with ss.Checkpointer(tmp_path, host_memory_gb=0.01, eager_copy_mb=0) as ckpt:
        for step in (1, 2, 3):
            model(torch.randn(2, 64)).sum().backward()
            ref = reference(state)
            gate = Gate(monkeypatch)
            opener = threading.Timer(0.3, gate.open)  # (save() itself may wait for weights that changed)
            opener.start()
            handle = ckpt.save(step, state)
            other.step()  # (writes nothing the snapshot holds)
            optim.step()
            optim.zero_grad()
            opener.join()
            assert_checkpoint_equals(handle.wait(), ref)


@pytest.mark.parametrize("closure", [False, True])
@pytest.mark.parametrize("write", ["in_place", "data"])
def test_a_step_pre_hook_of_the_users_registered_first_runs_after_the_wait(tmp_path, monkeypatch, write, closure):
    """PyTorch runs an optimizer's own pre-hooks in the order they were registered: a hook of the
    user's registered before the first save (a constraint on the weights) ran before statesnap's
    wait, and its writes went into the checkpoint (through ``.data``) or failed it (in place)."""
    model, optim = make_training()
    scale = (lambda p: p.mul_(0.5)) if write == "in_place" else (lambda p: p.data.mul_(0.5))

    def constrain(opt, args, kwargs):
        with torch.no_grad():
            for p in model.parameters():
                scale(p)
    optim.register_step_pre_hook(constrain)
    state = {"model": model, "optim": optim}
    with ss.Checkpointer(tmp_path, host_memory_gb=0.01, eager_copy_mb=0) as ckpt:
        for step in (1, 2):
            model(torch.randn(2, 32)).sum().backward()
            ref = reference(state)
            gate = Gate(monkeypatch)
            handle = ckpt.save(step, state)
            threading.Timer(0.3, gate.open).start()
            # (with a closure the wait came after it, and the optimizer's own pre-hooks before it)
            optim.step((lambda: None) if closure else None)
            optim.zero_grad()
            assert_checkpoint_equals(handle.wait(), ref)


def test_an_optimizer_left_out_of_the_state_stepped_in_on_commit_does_not_hang(tmp_path, monkeypatch):
    """on_commit runs on the committing thread: the step waited there for the next snapshot's
    copy, which waited for the arena space of the one committing. It is left to the version
    check there, as any writer in on_commit."""
    real = pipeline.copy_into
    monkeypatch.setattr(pipeline, "copy_into", lambda *a, **k: (time.sleep(0.02), real(*a, **k))[1])
    model, teacher = nn.Sequential(nn.Linear(256, 256)), nn.Sequential(nn.Linear(256, 256))
    teacher_optim = torch.optim.SGD(teacher.parameters(), lr=1e-6)
    for p in teacher.parameters():
        p.grad = torch.zeros_like(p)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.0015, eager_copy_mb=0, max_in_flight=2, on_error="warn",
                           on_commit=lambda record: teacher_optim.step())
    done = threading.Event()

    def run():
        for step in range(1, 6):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            ckpt.save(step, {"model": model, "teacher": teacher})
        ckpt.close()
        done.set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        threading.Thread(target=run, daemon=True).start()
        assert done.wait(60)


def test_a_fused_step_in_on_commit_drops_the_checkpoints_it_writes_under(tmp_path, monkeypatch):
    """A step in on_commit cannot wait (the copy may wait for the memory of the snapshot
    committing), and a fused step moves no version counter: the snapshots it would write under
    are dropped, where they committed the teacher's weights of after their save()."""
    real = pipeline.copy_into
    monkeypatch.setattr(pipeline, "copy_into", lambda *a, **k: (time.sleep(0.02), real(*a, **k))[1])
    torch.manual_seed(0)
    model, teacher = nn.Linear(128, 128), nn.Linear(128, 128)
    teacher_optim = torch.optim.Adam(teacher.parameters(), lr=0.1, fused=True)
    for p in teacher.parameters():
        p.grad = torch.randn_like(p)
    state = {"model": model, "teacher": teacher}
    mutex = threading.Lock()

    def on_commit(record):
        with mutex:
            teacher_optim.step()
    ckpt = ss.Checkpointer(tmp_path, eager_copy_mb=0, max_in_flight=2, keep_last=100, on_error="warn",
                           on_commit=on_commit)
    refs, handles = {}, {}
    for step in range(1, 7):
        ckpt._wait_for_slot(step)  # (outside the mutex: the slot waits for on_commit's return)
        with mutex:  # (no step in on_commit between the reference and save())
            with torch.no_grad():
                model.weight.add_(1.0)
            refs[step] = reference(state)
            handles[step] = ckpt.save(step, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ckpt.close()
    committed = 0
    for step, handle in handles.items():
        try:
            path = handle.durable.result(0)
        except ss.ConsistencyError:
            continue
        assert_checkpoint_equals(path, refs[step])
        committed += 1
    assert committed >= 1
