"""Blocking only on overwrite: step hooks, method guards and version-counter checks.

Forward and backward only read parameters and optimizer state, so the snapshot copies run while
they do. The first thing that writes is the optimizer step, and three kinds of writer are held
back until the copies they could overwrite are done:

- each ``torch.optim.Optimizer`` in the state, or inside a wrapper there (its ``.optimizer``),
  waits before its step until the tensors *that* optimizer changes (its parameters and its
  state) are copied, and no longer. A subclass that never ran ``Optimizer.__init__`` takes
  no hooks (accelerate's ``AcceleratedOptimizer`` wraps a torch optimizer that way): it is
  guarded like the wrappers below, and the torch optimizer in its ``.optimizer`` waits;
- any other torch optimizer (one left out of the state: a weights-only Checkpointer) waits
  before its step until every snapshot in flight is copied, where it would write a tensor one
  of them still copies. Its writes cannot be left to the version check: the fused kernels
  (``fused=True``) move no version counter.

  Both wait in one global step pre-hook, installed once: PyTorch runs the global hooks before
  each optimizer's own, so a hook of the user's that changes the parameters (a constraint, a
  projection) runs after the wait, not before it. (Global hooks registered before the first
  Checkpointer still run first.)
- an optimizer-like wrapper that is no torch optimizer (DeepSpeed's, Megatron's, apex's: a
  callable ``step`` and ``param_groups`` or an inner ``.optimizer``) has its ``step`` wrapped
  (on its class, for that instance). Such wrappers write tensors that are not in their
  ``param_groups`` (DeepSpeed and Megatron copy fp32 master weights into the model's 16-bit
  parameters through ``.data``), so what they write cannot be known: the wrapped step waits
  until every snapshot in flight is staged;
- ``Checkpointer.guard(obj, method)`` wraps any other method the same way (an EMA's update).

Whatever else writes is detected, not held back: an in-place operation bumps the tensor's
version counter, which is checked after the copy, and that checkpoint fails instead of mixing
two steps. Writes through ``.data``, and to the memory under a tensor (a numpy view, ctypes),
bump no counter: made outside a guarded method they go unseen, and the checkpoint holds whatever
the copy read, unless the tensor was copied inside ``save()`` (the eager copy of the tensors no
torch optimizer writes, up to ``eager_copy_mb``).
"""
from __future__ import annotations

import functools
import inspect
import os
import threading
import warnings
import weakref
from typing import Callable, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import CheckpointError, ConsistencyError
from ..monitor.events import now
from ..state.placement import is_dtensor


class Countdown:
    """Outstanding work that someone waits for. Starts at one (the "still adding work" token),
    so it cannot reach zero before all work has been added; ``release`` opens it on failure."""

    def __init__(self, on_zero: Callable[[], None] | None = None):
        self._count = 1
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._on_zero = on_zero

    def add(self) -> None:
        with self._lock:
            self._count += 1

    def finish(self) -> None:
        with self._lock:
            self._count -= 1
            reached = self._count == 0
        if reached:
            # (dropped once run: a callback holding what holds this countdown, a snapshot, made a
            # cycle, which only the cyclic collector freed, with the snapshot's copies, late)
            on_zero, self._on_zero = self._on_zero, None
            if on_zero is not None:
                on_zero()
            self._done.set()

    def release(self) -> None:
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


def storage_base(t: torch.Tensor) -> int:
    """Where the whole storage under a tensor (its local shard's, for a DTensor) begins: views of one
    storage, at any offset, share it."""
    if is_dtensor(t):
        t = t.to_local()
    return t.untyped_storage().data_ptr()


def optimizer_storages(optim: torch.optim.Optimizer) -> set[int]:
    """Storages the next ``optim.step()`` writes: its parameters and its per-parameter state."""
    ptrs = set()
    for group in optim.param_groups:
        for p in group["params"]:
            ptrs.add(storage_base(p))
            for value in optim.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    ptrs.add(storage_base(value))
    return ptrs


# What LR schedulers keep and optimizer wrappers do not: torch's, DeepSpeed's and Megatron's count
# their steps (``last_epoch``, ``last_batch_iteration``, ``num_steps``) and give ``get_last_lr``,
# timm's keep ``base_values``; and most say what they are in their names.
_SCHEDULER_ATTRIBUTES = ("last_epoch", "last_batch_iteration", "num_steps", "get_last_lr", "base_lrs", "base_values")
# values that hold no optimizer: skipped without a look while the state is searched at every save
_NO_WRITERS = frozenset({int, float, bool, str, bytes, type(None), torch.Tensor, torch.nn.Parameter})


def _is_scheduler_like(obj) -> bool:
    name = type(obj).__name__
    return name.endswith("LR") or "Scheduler" in name or any(hasattr(obj, a) for a in _SCHEDULER_ATTRIBUTES)


def is_optimizer_like(obj) -> bool:
    """Steps like an optimizer but is no torch one: a callable ``step`` and ``param_groups`` or an
    inner ``.optimizer`` that steps. LR schedulers also have a ``step`` and an ``.optimizer``, but
    change only hyperparameters: taken for a wrapper (DeepSpeed's ``WarmupLR``), one made the save
    trust that only guarded methods change what no optimizer writes, and a buffer the forward
    changes was copied while it changed."""
    if isinstance(obj, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)):
        return False
    if not callable(getattr(obj, "step", None)) or _is_scheduler_like(obj):
        return False
    return hasattr(obj, "param_groups") or callable(getattr(getattr(obj, "optimizer", None), "step", None))


def takes_step_hooks(optim: torch.optim.Optimizer) -> bool:
    """Whether ``register_step_pre_hook`` works on ``optim``: not on an instance of a subclass
    whose ``__init__`` never called ``Optimizer.__init__``, which creates the hook tables
    (accelerate's ``AcceleratedOptimizer``, which forwards to the optimizer it wraps)."""
    try:
        optim._optimizer_step_pre_hooks  # noqa: B018 (torch's own attribute, set in Optimizer.__init__)
    except AttributeError:
        return False
    return True


def find_writers(state) -> tuple[list[torch.optim.Optimizer], list]:
    """The torch optimizers and the optimizer-like wrappers among the values of ``state`` (nested
    dicts, lists and tuples, as the flattening walks them) and, for each, the chain of
    ``.optimizer``s it wraps. Inner ones come first, so that a tensor two optimizers claim is
    owned by the one whose step writes it, whichever step the training loop calls. (An optimizer
    in a list went unhooked: saved, but its step did not wait for the copies of what it writes.)"""
    optimizers, wrappers, seen, walked = [], [], set(), set()
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, (dict, list, tuple)):
            if id(value) not in walked:  # (a container holding itself is refused by the flattening after)
                walked.add(id(value))
                stack.extend(v for v in (value.values() if isinstance(value, dict) else value)
                             if type(v) not in _NO_WRITERS)
            continue
        chain = []
        while (isinstance(value, torch.optim.Optimizer) or is_optimizer_like(value)) and id(value) not in seen:
            seen.add(id(value))
            chain.append(value)
            value = getattr(value, "optimizer", None)
        for obj in reversed(chain):
            (optimizers if isinstance(obj, torch.optim.Optimizer) else wrappers).append(obj)
    return optimizers, wrappers


def owners_of(tensors: Iterable[torch.Tensor], optimizers: list[torch.optim.Optimizer]
              ) -> tuple[list[int | None], dict[int, int]]:
    """For each tensor, the owner whose step changes it (None: no optimizer does), and each
    optimizer's owner. An owner is an optimizer's id; optimizers that hold a tensor together (two
    over the same parameters) share one, that of the first: each one's step then waits for the
    copies of all they hold, where the second's step changed parameters owned by the first
    without a wait, and every checkpoint failed."""
    first_by_ptr, joined = {}, {id(optim): id(optim) for optim in optimizers}

    def owner(key: int) -> int:
        while joined[key] != key:
            joined[key] = key = joined[joined[key]]  # (halving the path: many optimizers joined stay quick)
        return key
    for optim in optimizers:
        for ptr in optimizer_storages(optim):
            first, mine = owner(first_by_ptr.setdefault(ptr, id(optim))), owner(id(optim))
            if first != mine:
                joined[mine] = first
    owner_keys = {key: owner(key) for key in joined}
    return [owner_keys.get(first_by_ptr.get(storage_base(t))) for t in tensors], owner_keys


def version_of(t: torch.Tensor) -> int | None:
    """The in-place version counter, or None for tensors without one (inference tensors: made in
    inference mode, they report 0 whatever changes them once detached outside it)."""
    local = t.to_local() if is_dtensor(t) else t
    if local.is_inference():
        return None
    return local._version


def changed_since_save(fqn: str, step: int) -> ConsistencyError:
    """A tensor changed in place after ``save()`` by neither its optimizer's step nor a guarded
    method, found before the checkpoint commits or the next step: the copy may have run while
    the change did, and on the CPU the check right after the copy can miss one still under way."""
    return ConsistencyError(
        f"checkpoint of step {step}: tensor {fqn!r} was changed in place after save() by something other "
        "than its optimizer's step or a method given to ckpt.guard(), so this checkpoint may mix two steps "
        "and was dropped. Call ckpt.wait_staged() before changing saved tensors outside optimizer.step(), "
        "or guard the method that changes them")


def storage_of(t: torch.Tensor) -> int:
    """Where a tensor's values lie now (its local shard's, for a DTensor): ``t.data = other``
    moves them without moving the version counter."""
    return (t.to_local() if is_dtensor(t) else t).data_ptr()


def check_unchanged(t: torch.Tensor, expected: int | None, where: int, fqn: str, step: int) -> None:
    """Raise if ``t`` changed in place since its version was ``expected``, or was given other
    memory than ``where`` (an optimizer's state tensor is copied from whatever memory it holds
    when its copy runs: ``exp_avg.data = ...`` after save() put the new values in the checkpoint)."""
    if storage_of(t) != where:
        raise ConsistencyError(
            f"checkpoint of step {step}: tensor {fqn!r} was given other memory (its .data reassigned) after "
            "save() and before its snapshot copy finished, so this checkpoint would hold values of after save() "
            "and was dropped. Reassign saved tensors' .data only after ckpt.wait_staged(), or inside "
            "optimizer.step() or a method given to ckpt.guard()")
    if expected is not None and version_of(t) != expected:
        raise ConsistencyError(
            f"checkpoint of step {step}: tensor {fqn!r} was changed in place after save() and before its "
            "snapshot copy finished, so this checkpoint would mix two steps and was dropped. Change "
            "tensors in place only inside optimizer.step() or a method given to ckpt.guard() (they wait "
            "for the copy), or call ckpt.wait_staged() before the change")


_ABSENT = object()


def _class_attr(cls: type, name: str):
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return _ABSENT


class _ClassPatch:
    """A method replaced on a class by one that waits first when called on a guarded instance.

    The class, not the instance: a method put on an instance would travel with copies of it
    (``copy.copy``, ``deepcopy``, ``DataParallel`` replicas, which copy ``__dict__``) and call
    the original object's method from the copy, and could not be pickled. On the class, the
    replacement dispatches on ``self``: other instances (copies included) only pass through it.
    """

    def __init__(self, cls: type, name: str):
        self.cls, self.name = cls, name
        self.own = vars(cls).get(name, _ABSENT)  # put back when the last guard goes
        found = _class_attr(cls, name)
        self.guards: dict[int, tuple] = {}  # id(instance) -> ((instance ref, StepGuard ref), ...)
        patch = self

        def guarded(obj, *args, **kwargs):
            for ref, guard_ref in patch.guards.get(id(obj), ()):
                guard = guard_ref()
                if ref() is obj and guard is not None:
                    guard.wait_all()
            if found is _ABSENT:  # a wrapper that forwards attributes to the object it wraps
                return cls.__getattr__(obj, name)(*args, **kwargs)
            get = getattr(type(found), "__get__", None)
            return (get(found, obj, type(obj)) if get is not None else found)(*args, **kwargs)
        if inspect.isfunction(found):
            functools.update_wrapper(guarded, found)  # name, doc, and flags such as torch's "hooked"
        self.function = guarded

    def installed(self) -> bool:
        return vars(self.cls).get(self.name) is self.function

    def restore(self) -> None:
        if not self.installed():
            return  # patched again on top of this since: this one stays, passing calls through
        if self.own is _ABSENT:
            delattr(self.cls, self.name)
        else:
            setattr(self.cls, self.name, self.own)


_patches: dict[tuple[type, str], _ClassPatch] = {}  # methods replaced now, over all Checkpointers
_patches_lock = threading.Lock()


_guards: weakref.WeakSet = weakref.WeakSet()  # every open Checkpointer's StepGuard (under _guards_lock)
_guards_lock = threading.Lock()
_installed = False


def _forget_guards_in_child() -> None:
    """A forked child's optimizers are its own: the parent's guards (and their lock, which another
    thread may have held at the fork: every step of the child hung on it) are not."""
    global _guards, _guards_lock
    _guards, _guards_lock = weakref.WeakSet(), threading.Lock()


os.register_at_fork(after_in_child=_forget_guards_in_child)


def _install_global_hook() -> None:
    global _installed
    with _guards_lock:
        if not _installed:
            register_optimizer_step_pre_hook(_before_any_step)
            _installed = True


@torch.compiler.disable  # (it waits on threads: nothing a graph holds)
def _before_any_step(optim: torch.optim.Optimizer, args, kwargs):
    """Every torch optimizer's step, before it: each open Checkpointer holds it back as it must."""
    if not _guards:  # (every Checkpointer closed: each step of the process passes here)
        return None
    changed = False
    with _guards_lock:  # (a Checkpointer opened or closed on another thread changes the set)
        guards = list(_guards)
    for guard in guards:
        result = guard.before_step(optim, args, kwargs)
        if result is not None:
            (args, kwargs), changed = result, True
    return (args, kwargs) if changed else None


class StepGuard:
    """Holds writers back until the in-flight snapshots' copies are done: torch optimizers through
    the global step pre-hook (``before_step``), and guarded methods (optimizer-like wrappers'
    ``step``, ``Checkpointer.guard``).

    ``gates_for(optimizer_id)`` returns the (step, Countdown) pairs that optimizer's step waits
    for; ``gates_for(None)`` those of every snapshot's whole copy. ``on_wait`` records how long a
    writer was held back.
    """

    def __init__(self, gates_for: Callable[[int | None], list], on_wait: Callable[[int, float, float], None],
                 released: Callable[[int | None], None] = lambda optimizer_id: None,
                 copying: Callable[[set[int]], bool] = lambda storages: False):
        self._gates_for = gates_for
        self._on_wait = on_wait
        self._pid = os.getpid()
        self._released = released  # (optimizer id, or None: a guarded method) after its wait
        self._copying = copying  # whether a snapshot in flight still copies a tensor of these storages
        self._watched: dict[int, weakref.ref] = {}
        self._others: dict[int, tuple[weakref.ref, tuple, set[int]]] = {}  # optimizers outside the state
        self._guarded: dict[tuple[int, str], tuple[weakref.ref, _ClassPatch]] = {}
        _install_global_hook()
        with _guards_lock:
            _guards.add(self)

    def watch(self, optimizers: Iterable[torch.optim.Optimizer], wrappers: Iterable = ()) -> None:
        unhooked = []
        for optim in optimizers:
            known = self._watched.get(id(optim))
            if known is None or known() is not optim:  # ids of collected objects are reused
                if not takes_step_hooks(optim):
                    unhooked.append(optim)
                    continue
                self._watched[id(optim)] = weakref.ref(optim)
        for wrapper in [*unhooked, *wrappers]:
            try:
                self.guard(wrapper, "step")
            except CheckpointError as exc:
                warnings.warn(f"{exc}; its step is not held back until the snapshot copies are done: call "
                              "ckpt.wait_staged() before it", RuntimeWarning, stacklevel=3)

    def guards_methods(self) -> bool:
        """Whether some method is guarded (``guard``, or the step of an optimizer-like wrapper)."""
        return bool(self._guarded)

    def watched(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose step is hooked now (those still alive)."""
        return [optim for ref in self._watched.values() if (optim := ref()) is not None]

    def guard(self, obj, name: str) -> None:
        """Make ``obj.<name>(...)`` wait first until every snapshot in flight is staged. Guarding
        what is already guarded does nothing; :meth:`close` undoes it. Objects are held weakly.
        A torch optimizer's ``step`` gets the pre-step hook instead (:meth:`watch`)."""
        if name == "step" and isinstance(obj, torch.optim.Optimizer) and takes_step_hooks(obj):
            self.watch([obj])
            return
        known = self._guarded.get((id(obj), name))
        if known is not None and known[0]() is obj:
            return
        what, cls = f"{type(obj).__name__}.{name}", type(obj)
        if not callable(getattr(obj, name, None)):
            raise CheckpointError(f"cannot guard {what}: it is not a method of the object")
        if name in getattr(obj, "__dict__", {}):
            raise CheckpointError(f"cannot guard {what}: the object has its own attribute {name!r}, which "
                                  "hides the method of its class")
        if hasattr(type(_class_attr(cls, name)), "__set__"):
            raise CheckpointError(f"cannot guard {what}: it is a property of the class")
        try:
            ref = weakref.ref(obj)
        except TypeError:
            raise CheckpointError(f"cannot guard {what}: the object takes no weak references") from None
        with _patches_lock:
            patch = _patches.get((cls, name))
            if patch is None or not patch.installed():
                patch = _ClassPatch(cls, name)
                try:
                    setattr(cls, name, patch.function)
                except (TypeError, AttributeError) as exc:  # a built-in or extension type
                    raise CheckpointError(f"cannot guard {what}: its class cannot be changed ({exc})") from None
                _patches[(cls, name)] = patch
            patch.guards[id(obj)] = (*patch.guards.get(id(obj), ()), (ref, weakref.ref(self)))
        self._guarded[(id(obj), name)] = (ref, patch)

    def wait_all(self) -> None:
        self._wait(None)

    def before_step(self, optim: torch.optim.Optimizer, args, kwargs):
        """An optimizer is about to step (the global hook): one of the state's waits for its
        copies (``_hook``); another waits for every snapshot's copy where it writes a tensor one
        still copies."""
        if os.getpid() != self._pid:  # a forked child: its writes go to its own copy (and a lock may be held)
            return None
        known = self._watched.get(id(optim))
        if known is not None and known() is optim:
            return self._hook(optim, args, kwargs)
        if self._copying(self._storages_of_other(optim)):
            self._wait(None)
        return None

    def _storages_of_other(self, optim: torch.optim.Optimizer) -> set[int]:
        """``optimizer_storages`` of an optimizer outside the state, kept while its parameters and
        the size of its state stay (a step with a snapshot in flight would otherwise walk them)."""
        key = (len(optim.param_groups), sum(len(g["params"]) for g in optim.param_groups), len(optim.state))
        known = self._others.get(id(optim))
        if known is None or known[0]() is not optim or known[1] != key:
            # (dropped with the optimizer: a process making optimizer after optimizer kept them all)
            forget = functools.partial(self._others.pop, id(optim), None)
            known = self._others[id(optim)] = (weakref.ref(optim, lambda _: forget()), key,
                                               optimizer_storages(optim))
        return known[2]

    def _hook(self, optim, args, kwargs):
        """Wait before the step changes this optimizer's tensors. A torch optimizer's step given
        a closure runs the forward and backward inside it first (Lightning, LBFGS): wait when the
        closure returns, not before it, so that they still overlap the copy. Another optimizer's
        step may change its parameters before it calls its closure (SAM's does): it waits first."""
        if not (getattr(type(optim).step, "__module__", None) or "").startswith("torch.optim."):
            self._wait(id(optim))
            return None
        # Pre-hooks of the optimizer's own run before the step, so before a wait after the closure:
        # one that changes the weights (a constraint) would change them under the copy.
        if not optim._optimizer_step_pre_hooks:
            if kwargs.get("closure") is not None:
                return args, {**kwargs, "closure": self._after(kwargs["closure"], id(optim))}
            if len(args) > 1 and callable(args[1]):  # args[0] is the optimizer itself
                return (args[0], self._after(args[1], id(optim)), *args[2:]), kwargs
        self._wait(id(optim))
        return None

    def _after(self, closure: Callable, optimizer_id: int) -> Callable:
        def closure_then_wait():
            try:
                return closure()
            finally:
                self._wait(optimizer_id)
        return closure_then_wait

    def _wait(self, optimizer_id: int | None) -> None:
        if os.getpid() != self._pid:  # a forked child: its writes go to its own copy of the memory
            return
        for step, gate in self._gates_for(optimizer_id):
            if not gate.done():
                start = now()
                gate.wait()
                self._on_wait(step, start, now())
        self._released(optimizer_id)  # what the writer changes from now on is its own

    def close(self) -> None:
        """Remove every hook and guard; a class gets its method back when no guard needs it."""
        with _guards_lock:
            _guards.discard(self)
        self._watched.clear()
        self._others.clear()
        with _patches_lock:
            for (key, _), (_, patch) in self._guarded.items():
                left = tuple(entry for entry in patch.guards.pop(key, ()) if entry[1]() not in (None, self))
                if left:
                    patch.guards[key] = left
                if not patch.guards:
                    patch.restore()
                    if _patches.get((patch.cls, patch.name)) is patch:
                        del _patches[(patch.cls, patch.name)]
        self._guarded.clear()
