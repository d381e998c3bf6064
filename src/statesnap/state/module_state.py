"""A module's state dict for a save, and putting it back after a load.

PyTorch's ``get_model_state_dict`` is taken only where it renames anything (wrappers), since it
costs microseconds per tensor; after a load, ``load_state_dict`` is called only where it does more
than copy each tensor onto itself, which for a thousand small tensors took longer than the reads.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

from .items import SEP, join


def model_state_dict(module: nn.Module) -> dict:
    """The module's state dict by PyTorch's helper where it renames anything, else the module's
    own (the same dict: the helper takes it and only renames the keys of wrappers, at a few
    microseconds per tensor). The helper also refuses a module without parameters or buffers (a
    ``ReLU``, a container of them): its check for an empty state dict builds its message with the
    process group's rank, so it fails without one. Such a module's own state dict is all it has
    (its extra state, if any)."""
    if holds_no_tensors(module):
        return module.state_dict()
    if not renamed_by_helper(module):
        # Without autograd, as the helper takes it: extra state or a hook's tensor derived from a
        # parameter would otherwise require grad, tied to the weights a load then writes in place
        # (the next backward through it failed: modified by an inplace operation).
        with torch.no_grad():
            return module.state_dict()
    return get_model_state_dict(module)


# Submodule names under which PyTorch's helper finds a wrapper and drops the name from the keys:
# torch.compile's module, activation checkpointing's wrapper, FSDP1's wrapped module.
_WRAPPED_NAMES = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
_WRAPPERS = (DistributedDataParallel, FullyShardedDataParallel)


def renamed_by_helper(module: nn.Module) -> bool:
    """Whether ``get_model_state_dict`` may give ``module`` other keys or values than its own
    ``state_dict``: a DDP or FSDP1 wrapper in it (FSDP1 also gathers its flat parameters), or a
    wrapper known by the name it keeps its module under."""
    return any(isinstance(m, _WRAPPERS) or not _WRAPPED_NAMES.isdisjoint(m._modules) for m in module.modules())


def holds_no_tensors(module: nn.Module) -> bool:
    return next(itertools.chain(module.parameters(), module.buffers()), None) is None


def load_module(module: nn.Module, sd: dict) -> None:
    if not sd and holds_no_tensors(module):
        module.load_state_dict(sd)  # (PyTorch's helper refuses it, as above)
    elif not filled_in_place(module, sd):
        set_model_state_dict(module, sd)


def filled_in_place(module: nn.Module, sd: dict) -> bool:
    """Whether the load has already put every value of ``sd`` where the module keeps it: all are
    plain tensors sharing the memory of the module's own parameters and buffers (as
    ``get_model_state_dict`` returns them when no FSDP wrapping copies them), and no module in it
    customises loading (hooks, its own ``_load_from_state_dict``, ``load_state_dict`` or extra
    state, on its class or on the instance). Then ``load_state_dict`` would only copy each tensor
    onto itself, which for a thousand small tensors took longer than reading them. A state dict
    that ``Module.state_dict`` made without hooks or overrides holds each parameter and buffer
    detached, so only others have their values' memory compared with the module's (a thousand
    comparisons took 0.8 ms). (The load counts its writes as in-place changes itself:
    engine/load.py.)"""
    if _customised(module, "load_state_dict"):
        return False
    for m in module.modules():
        if (m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks or _customised(m, "_load_from_state_dict")
                or _customised(m, "set_extra_state")):
            return False
    if not all(type(v) is torch.Tensor for v in sd.values()):
        return False
    # (sd is the module's own state_dict() where no helper renames it)
    if not renamed_by_helper(module) and _saves_as_is(module):  # each value a parameter or buffer detached
        return True
    own = {t.data_ptr(): t for t in (*module.parameters(), *module.buffers())}  # (two at one address: a miss)
    return all(_same_layout(v, own.get(v.data_ptr())) for v in sd.values())


def _saves_as_is(module: nn.Module) -> bool:
    """Whether every value of ``module``'s state dict is a parameter or buffer of its own, detached
    (``Module._save_to_state_dict``): no module in it has state-dict hooks or overrides."""
    return not any(m._state_dict_pre_hooks or m._state_dict_hooks or _customised(m, "state_dict")
                   or _customised(m, "_save_to_state_dict") or _customised(m, "get_extra_state")
                   for m in module.modules())


def _same_layout(value: torch.Tensor, own: torch.Tensor | None) -> bool:
    return own is not None and value.dtype == own.dtype and value.shape == own.shape and value.stride() == own.stride()


def _customised(module: nn.Module, method: str) -> bool:
    return getattr(type(module), method) is not getattr(nn.Module, method) or method in vars(module)


def tie_origins(module: nn.Module, prefix: str, items: list) -> None:
    """Give each DTensor item of ``module``'s state dict (its names under ``prefix``) the module's
    own parameter or buffer as its ``origin``. ``Module.state_dict`` detaches every name apart, so
    the two names of one tied weight held two DTensors, and a rank whose part of it is empty could
    not tell them one (engine/overlaps.py ``aliases_filled``) while the others could. Only where
    each value is the module's own tensor: a state-dict hook may give the two names two copies.
    Names as PyTorch's state-dict helper gives them (without ``_orig_mod.`` of torch.compile and
    the like)."""
    if not any(item.origin is not None for item in items) or not _saves_as_is(module):
        return
    named = itertools.chain(module.named_parameters(remove_duplicate=False),
                            module.named_buffers(remove_duplicate=False))
    own = {_helper_name(prefix, name): tensor for name, tensor in named}
    for item in items:
        if item.origin is not None:
            item.origin = own.get(item.fqn, item.origin)


def _helper_name(prefix: str, name: str) -> str:
    """``name`` under ``prefix`` as PyTorch's state-dict helper names it (no wrappers' parts)."""
    return join(prefix, SEP.join(part for part in name.split(SEP) if part not in _WRAPPED_NAMES))
