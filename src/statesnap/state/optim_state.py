"""A fresh optimizer's state for a load, and an optimizer's state dict for a save, without
stepping it.

PyTorch's ``get_optimizer_state_dict`` creates the state of an optimizer that has none by
taking a step at lr 0. A step does more than make state: a subclass's extra work (an EMA),
step hooks, an LR scheduler's wrapper, an update that does not scale with lr. It is also
skipped when any parameter holds a gradient, which left a load with nothing to fill. So a save
hands the helper a state it takes as made, and a load creates the state of PyTorch's optimizers
itself from what the checkpoint holds (``create_state_from_checkpoint``): for exactly the
parameters the checkpoint keeps state for, so one no gradient had reached before the save stays
without, as in the run that saved it. Only other kinds still take the helper's step, unseen by
hooks and with the parameters' gradients set aside.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from ..errors import CheckpointError
from .items import SEP
from .placement import is_dtensor


def state_dict_without_step(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """``get_optimizer_state_dict`` of an optimizer without state, where none is wanted (a save;
    a load of a checkpoint that holds none for it): the helper would create it with a step at
    lr 0, and a step does more than its update. A stateless SGD has no state after any number of
    steps, so every save ran its ``step``: a subclass's extra work (an EMA it updates), its
    step hooks (``register_step_post_hook``), an optimizer whose update does not scale with
    ``lr`` (Adafactor's relative step) changed the training. The helper is handed an empty
    state for each parameter, which it takes as made: it neither steps nor first gives each
    parameter a zero gradient (memory of the parameters' size, at every save). Where the
    optimizer's ``state_dict`` cannot take them (a subclass's or a hook's that reads keys of its
    own from the state), its step is held back instead."""
    try:
        with _marked(optim, indexed=False):
            sd = get_optimizer_state_dict(model, optim)
    except Exception:  # noqa: BLE001 (any subclass's or hook's error)
        with _step_replaced(optim, lambda *args, **kwargs: None):
            sd = get_optimizer_state_dict(model, optim)
    sd["state"] = {}
    return sd


@contextlib.contextmanager
def _step_replaced(optim: torch.optim.Optimizer, step: Callable):
    """``optim.step`` is ``step`` for the block: set on the object, over the class's method and
    over what an LR scheduler puts on the object (its wrapper, which marks the optimizer stepped)."""
    own = vars(optim).get("step", _NO_OWN_STEP)
    optim.step = step
    try:
        yield
    finally:
        if own is _NO_OWN_STEP:
            del optim.step
        else:
            optim.step = own


_NO_OWN_STEP = object()


def state_dict_by_a_step(model: nn.Module, optim: torch.optim.Optimizer, fqn: str) -> dict:
    """``get_optimizer_state_dict`` of an optimizer without state, which that helper creates with
    one step at lr 0. An optimizer whose step needs a closure (LBFGS) refuses it, and the
    helper then left the lr at 0: put the hyperparameters back, and say what went wrong."""
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in optim.param_groups]
    try:
        with _step_unobserved(optim):
            return get_optimizer_state_dict(model, optim)
    except Exception as exc:
        for group, saved in zip(optim.param_groups, hyper):
            group.update(saved)
        optim.state.clear()
        raise CheckpointError(
            f"{fqn}: the {type(optim).__name__} has no state yet, and PyTorch's state-dict helper, which "
            f"creates it with one step at lr 0 and no closure, failed ({type(exc).__name__}: {exc}). An "
            "optimizer whose step needs a closure (LBFGS) cannot be stepped so: take one step with it before "
            "saving or loading its state") from exc


@contextlib.contextmanager
def _step_unobserved(optim: torch.optim.Optimizer):
    """The step that creates a fresh optimizer's state for a load, taken unseen by what watches
    the training's steps: the optimizer's step hooks (``register_step_pre_hook``/``post_hook``:
    an EMA, a step counter, a logger ran once more per load) and an LR scheduler's wrapper on
    the object's ``step`` (it marks the optimizer stepped, which silences PyTorch's warning
    about a scheduler stepped first). The step itself, a subclass's included, still runs: it
    is what makes the state. Hooks registered on all optimizers at once still see it.

    The parameters' gradients are set aside for it and put back after: the helper takes no step
    where any parameter holds one (a load after a backward pass), which left the load nothing to
    fill and failed it as a mismatch."""
    hooks = {name: vars(optim)[name] for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
             if isinstance(vars(optim).get(name), dict)}
    grads = [(p, p.grad) for group in optim.param_groups for p in group["params"] if p.grad is not None]
    for name, table in hooks.items():
        setattr(optim, name, type(table)())
    for p, _ in grads:
        p.grad = None
    try:
        with _step_replaced(optim, functools.partial(type(optim).step, optim)):
            yield
    finally:
        for name, table in hooks.items():
            setattr(optim, name, table)
        for p, grad in grads:
            p.grad = grad


def positional_holder(optim: torch.optim.Optimizer) -> nn.Module:
    """A module holding the optimizer's parameters under their positions, for PyTorch's
    state-dict helper to create a fresh optimizer's state with (it needs a module); the state
    dict then taken from the optimizer itself is keyed by position, as such state is stored."""
    holder = nn.Module()
    for position, param in enumerate(p for group in optim.param_groups for p in group["params"]):
        # (not register_parameter: it refuses the plain leaf tensors optimizers accept too)
        holder._parameters[str(position)] = param
    return holder


def create_adam_state(optim: torch.optim.Optimizer, created: list[torch.Tensor] | None = None) -> None:
    """Give each parameter of an Adam/AdamW that has no state yet the state its first step would
    create (as ``Adam._init_group`` does: same dtypes, devices and memory formats), without
    running a step; parameters that have state keep it. The moments are left unfilled when the
    caller collects them in ``created`` (a load fills them from the checkpoint and zeroes what it
    does not fill), zeroed otherwise: zero moments at step 0 are what the optimizer would create
    itself at the parameter's first gradient, so its updates do not change. Other optimizers are
    left alone: SGD's first momentum is the gradient, not zero.

    A Checkpointer of several ranks uses it at every save, so that every rank's layout is
    complete from its first save on; a load where the checkpoint holds other keys than Adam's
    (``create_state_from_checkpoint`` declined), which the load then names as a mismatch."""
    if type(optim) not in (torch.optim.Adam, torch.optim.AdamW):
        return
    new = torch.empty_like if created is not None else torch.zeros_like
    for group in optim.param_groups:
        device_step = group.get("capturable") or group.get("fused")
        scalar = torch.float32 if group.get("fused") or torch.get_default_dtype() != torch.float64 else torch.float64
        for p in group["params"]:
            if not p.requires_grad or optim.state.get(p):  # (reading optim.state[p] makes an empty one)
                continue
            state = optim.state[p]
            state["step"] = torch.zeros((), dtype=scalar, device=p.device if device_step else "cpu")
            moments = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg", "exp_avg_sq")
            for key in moments:
                state[key] = new(p, memory_format=torch.preserve_format)
                if created is not None:
                    created.append(state[key])


def _step_and(*keys: str) -> Callable[[dict, torch.Tensor], frozenset]:
    return lambda group, param: frozenset(("step", *keys))


def _optional(group: dict, **keys_by_option: str) -> tuple[str, ...]:
    return tuple(key for option, key in keys_by_option.items() if group.get(option))


# The state each of PyTorch's optimizers keeps for a parameter, by its param group's options
# (AdamW is an Adam). A checkpoint's state is created only where its keys are
# exactly these: a subclass that keeps more, or a checkpoint of another kind (Adam's state
# loaded into an SGD), takes the helper's step and so meets the same checks as before.
# tests/test_optim_state.py compares each with what a real step makes.
_STATE_KEYS: dict[str, Callable[[dict, torch.Tensor], frozenset | tuple[frozenset, frozenset]]] = {
    "Adam": lambda group, param: frozenset(("step", "exp_avg", "exp_avg_sq",
                                            *_optional(group, amsgrad="max_exp_avg_sq"))),
    "SGD": lambda group, param: frozenset(_optional(group, momentum="momentum_buffer")),
    "RMSprop": lambda group, param: frozenset(("step", "square_avg",
                                               *_optional(group, momentum="momentum_buffer", centered="grad_avg"))),
    "Adagrad": _step_and("sum"),
    "Adadelta": _step_and("square_avg", "acc_delta"),
    "Adamax": _step_and("exp_avg", "exp_inf"),
    "NAdam": _step_and("mu_product", "exp_avg", "exp_avg_sq"),
    "RAdam": _step_and("exp_avg", "exp_avg_sq"),
    "SparseAdam": _step_and("exp_avg", "exp_avg_sq"),
    "Rprop": _step_and("prev", "step_size"),
    "ASGD": _step_and("eta", "mu", "ax"),
    "Adafactor": lambda group, param: frozenset(("step", *(("row_var", "col_var") if param.dim() >= 2
                                                           else ("variance",)))),
    # under its first parameter only; the keys of its history once a step has made them
    "LBFGS": lambda group, param: (frozenset(("func_evals", "n_iter")), frozenset((
        "func_evals", "n_iter", "d", "t", "old_dirs", "old_stps", "ro", "al", "H_diag", "prev_flat_grad",
        "prev_loss"))),
}


def _fits(keys: set[str], expected: frozenset | tuple[frozenset, frozenset]) -> bool:
    """Whether stored ``keys`` are the ``expected`` ones: a set, or (required, allowed)."""
    if isinstance(expected, tuple):
        return expected[0] <= keys <= expected[1]
    return keys == expected


def _listed(keys: list[str]) -> dict[str, list[str] | None] | None:
    """The stored keys of one parameter's state by their first part: None for a value stored
    under its key, the element keys in order for a list stored element by element (LBFGS's
    history of large tensors, ``old_dirs.0``, ``old_dirs.1``, ...); None if neither."""
    out: dict[str, list[str] | None] = {}
    for key in keys:
        base, _, index = key.partition(SEP)
        if not index:
            out[base] = None
        elif index.isdigit():
            out.setdefault(base, []).append(key)
        else:
            return None
    for base, elements in out.items():
        if elements is not None:
            elements.sort(key=lambda key: int(key.partition(SEP)[2]))
            if [int(key.partition(SEP)[2]) for key in elements] != list(range(len(elements))):
                return None
    return out


def _state_keys_of(optim: torch.optim.Optimizer) -> Callable[[dict, torch.Tensor], frozenset] | None:
    """The state keys of the nearest of PyTorch's optimizers the optimizer's class derives from."""
    for cls in type(optim).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in _STATE_KEYS:
            return _STATE_KEYS[cls.__name__]
    return None


def _keeps_state_of_other_shapes(optim: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's kind keeps tensors neither of its parameter's shape nor scalars:
    Adafactor's factored variances, LBFGS's flat history. PyTorch's others keep no such state."""
    return any(cls.__name__ in ("Adafactor", "LBFGS") for cls in type(optim).__mro__
               if cls.__module__.startswith("torch.optim"))


def stored_param_names(groups) -> set[str]:
    """The parameters a checkpoint's param groups list (names, or positions), as strings; empty
    where they are not a list of groups."""
    try:
        return {str(p) for group in groups for p in group["params"]}
    except (TypeError, KeyError):
        return set()


def stored_state_differs(optim: torch.optim.Optimizer, sd: dict, prefix: str, stored, listed: set[str]) -> bool:
    """Whether the checkpoint keeps other state for the optimizer's parameters than ``sd`` (its
    state dict as the load names it) holds: other keys for a parameter (state made since the
    save, as for a layer unfrozen or an expert first reached since; none at all where the save
    came before the first step), or a tensor where the other holds a plain value (LBFGS's
    ``H_diag``). Only parameters the checkpoint's groups list (``listed``) count: a pipeline
    stage's optimizer holds a part of what rank 0's checkpoint keeps, and a parameter it does not
    know is no part of what it restores. Never where the checkpoint keeps state for a parameter
    that does not require grad now: PyTorch's helper would drop it without a word, where the load
    of the stepped optimizer names it (``prefix``: ``<optimizer>.state.``)."""
    state = sd.get("state", {})
    groups = sd.get("param_groups", ())
    if len(groups) != len(optim.param_groups):
        return False
    differs = False
    for group, names in zip(optim.param_groups, groups):
        for param, name in zip(group["params"], names.get("params", ())):
            if str(name) not in listed:
                continue
            where, held = f"{prefix}{name}{SEP}", state.get(name, {})
            keys = {key.split(SEP, 1)[0] for key in stored.keys_under(where)}
            if keys and not param.requires_grad:
                return False
            differs = differs or keys != {str(key) for key in held} or any(
                isinstance(value, torch.Tensor) != (stored.header(f"{where}{key}") is not None)
                for key, value in held.items())
    return differs


def restore_emptied(emptied: list) -> None:
    """Give each optimizer that a load emptied, as ``(optimizer, its state before)``, that state
    back (none, for one that was fresh): a load that fails, or loads another step, leaves it as
    it found it. Undone in reverse order: one set aside is then met again as fresh."""
    for optim, before in reversed(emptied):
        optim.state.clear()
        optim.state.update(before)


def create_state_from_checkpoint(optim: torch.optim.Optimizer, state_dict: Callable[[], dict], prefix: str,
                                 stored, created: list[torch.Tensor] | None = None,
                                 by_position: bool = False) -> dict | None:
    """Give a fresh optimizer, without a step, the state the checkpoint holds for it, and return
    its state dict. For each parameter the checkpoint keeps state for (under ``<prefix><its
    name>.``), each stored key gets a tensor (``_new_state_tensor``: floating state in a floating
    parameter's dtype, scalars and other state in the stored one; the parameter's shape and
    placement where the stored shape is the parameter's) or, for a value stored inline, a
    placeholder the load replaces. The optimizer's own ``load_state_dict`` then puts each where
    it keeps it (the parameter's device and dtype), as it does for any state dict.

    ``state_dict``: the optimizer's state dict as the load names it (PyTorch's helper, or the
    optimizer's own for state kept by position). It is taken once, over a state that marks each
    parameter (``_marked``), so that it names the parameters; what it returns, with the made
    state in place of the marks, is the state dict. A ``state_dict`` that does not hand each mark
    back as it was (a subclass's or a hook's that reads keys of its own, or casts the marks past
    what they hold) leaves the state to a step. ``stored``: the checkpoint's names and
    tensor headers (``StoredNames``). Tensors go to ``created`` for the load to fill, zeroed
    without it. ``by_position``: the checkpoint keys the state by the parameters' positions.

    Returns None, leaving the optimizer as it was, where the kind is not one of PyTorch's, a
    stored key set is not the one this optimizer keeps, a stored shape cannot be placed (state
    of another shape than a sharded parameter's), or no parameter's state is stored."""
    keys_of = _state_keys_of(optim)
    if keys_of is None or not stored.has_headers:
        return None
    groups = {id(p): group for group in optim.param_groups for p in group["params"]}
    try:
        with _marked(optim) as params:
            sd = state_dict()
        indices = {name: int(marks[_MARK]) for name, marks in sd["state"].items()}
    except Exception:  # noqa: BLE001 (any subclass's or hook's error)
        return None
    if sorted(indices.values()) != list(range(len(params))):
        return None
    made: dict = {}  # the state dict's name -> (parameter, its state)
    for name, index in indices.items():
        param, where = params[index], f"{prefix}{name}{SEP}"
        keys = stored.keys_under(where)
        if not keys:
            continue
        listed = _listed(keys)
        if listed is None or not _fits(set(listed), keys_of(groups[id(param)], param)):
            return None
        headers = {key: stored.header(where + key) for key in keys}
        if any(h is not None and h[0] and tuple(h[0]) != tuple(param.shape) for h in headers.values()) and (
                is_dtensor(param) or (by_position and not _keeps_state_of_other_shapes(optim))):
            # A DTensor's part on this rank: only the optimizer's step knows it (scalars are
            # whole). State kept by position of another shape than its parameter's, of a kind
            # whose state has its parameter's, is another parameter's (listed otherwise now):
            # the step's state then meets the load's check, which names it; made in the stored
            # shape, it was loaded, and the next step failed on it.
            return None
        made[name] = param, {key: _new_state_tensor(param, headers[key]) if elements is None else
                             [_new_state_tensor(param, headers[element]) for element in elements]
                             for key, elements in listed.items()}
    if not made:
        return None
    for param, state in made.values():
        for tensor in (t for value in state.values() for t in (value if isinstance(value, list) else [value])):
            if tensor is None:
                continue
            if created is None:
                tensor.zero_()
            else:
                created.append(tensor)
        optim.state[param] = state
    sd["state"] = {name: state for name, (_, state) in made.items()}
    return sd


def _new_state_tensor(param: torch.Tensor, header: tuple | None) -> torch.Tensor | None:
    """An unfilled tensor for a stored ``(shape, dtype)`` header beside ``param``, or None (a
    placeholder the load replaces) for a value stored inline. Scalars are made on the CPU, as
    PyTorch's optimizers keep them unless ``capturable`` (their ``load_state_dict`` then moves
    them), and of the stored dtype (``step``, NAdam's ``mu_product``: the optimizers' scalar
    dtype, not the parameter's). Other floating state is made of a floating parameter's dtype,
    as the optimizers make it: of the stored dtype, state saved in float32 was loaded silently
    into a fresh optimizer of bfloat16 parameters (its ``load_state_dict`` casts), where the load
    refuses another dtype without ``cast=True``, as it does for an optimizer that has state."""
    if header is None:
        return None
    shape, dtype = header
    if not shape:
        return torch.empty((), dtype=dtype)
    if dtype.is_floating_point and param.is_floating_point():
        dtype = param.dtype
    if tuple(shape) == tuple(param.shape):
        return torch.empty_like(param, dtype=dtype, memory_format=torch.preserve_format)
    return torch.empty(shape, dtype=dtype, device=param.device)


_MARK = "statesnap: parameter index"


@contextlib.contextmanager
def _marked(optim: torch.optim.Optimizer, indexed: bool = True):
    """For the block, the optimizer's state holds each parameter, marked with its index (or, not
    ``indexed``, empty); it is empty again after. Yields the parameters in that order. The index
    is a tensor: a subclass's ``state_dict`` or a state-dict hook that maps each value of the
    state (moves it to the CPU, casts it) takes a mark as it takes state (a plain int failed it:
    "'int' object has no attribute 'cpu'")."""
    params = [p for group in optim.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        optim.state[param] = {_MARK: torch.tensor(index)} if indexed else {}
    try:
        yield params
    finally:
        optim.state.clear()


NOT_STRICT = StateDictOptions(strict=False)


_MEMBERS = ("params", "param_names")  # what says which parameters a group holds (names: given named ones)


def group_members(sd: dict) -> list[dict]:
    """The parameters (names or positions) of each param group of the optimizer state dict ``sd``
    as this rank holds them, before a load puts the stored groups in their place."""
    return [{key: list(group[key]) for key in _MEMBERS if key in group}
            for group in sd.get("param_groups", ()) if isinstance(group, dict)]


def with_members(sd: dict, held: list[dict]) -> dict:
    """``sd`` with each stored param group given the parameters of this rank's group ``held``:
    the stored groups are rank 0's, whose names a pipeline stage's parameters do not have (each
    group was left without hyperparameters, a KeyError at the next step), and the checks before
    the load (state/flatten.py: ``_refuse_other_groups``, ``_refuse_regrouped``) made the groups
    correspond by position."""
    groups = sd.get("param_groups")
    if isinstance(groups, list) and len(groups) == len(held) and all(isinstance(g, dict) for g in groups):
        sd["param_groups"] = [{**group, **members} for group, members in zip(groups, held)]
    return sd


def load_optimizer_state(model: nn.Module, optim: torch.optim.Optimizer, sd: dict) -> None:
    """Put ``sd`` (a named optimizer state dict, filled by a load) into ``optim``."""
    if sd["state"]:
        # Not PyTorch's strict check: it refuses a parameter that requires a gradient and has no
        # state, which is every parameter that had no gradient in the saved run (a layer it did
        # not use), in the checkpoint and in the optimizer alike. The load matched the state's
        # names against the checkpoint's already, as strict as it was asked to (engine/load.py).
        set_optimizer_state_dict(model, optim, sd, options=NOT_STRICT)
        return
    # Nothing to restore but hyperparameters: leave the optimizer fresh (no state, no steps).
    for group, loaded in zip(optim.param_groups, sd["param_groups"]):
        group.update({k: v for k, v in loaded.items() if k != "params"})
