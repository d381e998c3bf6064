"""Reusing a module's or an optimizer's flattened tensor items from one save to the next.

``get_model_state_dict`` and ``get_optimizer_state_dict`` cost tens of microseconds per tensor
(name lookups through the module tree), tens of milliseconds for a thousand tensors, although a
training loop saves the same parameter and optimizer-state tensors step after step. A
:class:`ProviderCache` keeps what one flattening produced for each module and optimizer and hands
it back while a cheap check finds nothing it depends on changed:

- the *signature* of every live tensor (parameters, buffers, optimizer state values): its
  identity, data pointer, shape, strides and dtype, and for a DTensor its placements, mesh and
  local tensor. This sees a tensor replaced in the optimizer's state, ``param.data = ...``,
  ``resize_``/``set_`` in place, a DTensor swapped for one sharded otherwise. A module's plain
  tensors are checked more cheaply against aliases taken when it was cached (``is_set_to``: the
  same storage, offset, sizes and strides) and their dtypes, which sees the same. Optimizer state
  whose items are the state's own tensor objects (a plain optimizer's) is checked by identity
  alone, which reads no tensor: such an item follows ``.data =`` by itself, and a shape or dtype
  changed in place is refused by the snapshot's copy, which then drops the cache;
- a process-wide count of parameter, buffer and submodule registrations on the cached modules
  and their submodules (PyTorch's global registration hooks): ``module.weight =
  nn.Parameter(...)``, a new buffer or submodule;
- the optimizer's parameter identities per param group (``add_param_group``), the count and keys
  of its per-parameter state (state created by the first step after a save), and the modules of
  the state (which one owns the optimizer's parameters).

Only the tensor structure is reused: plain values (param-group hyperparameters, non-tensor
optimizer state) are read again from the live objects at every save. What is not a view of the
live tensors (FSDP1's gathered copies, a module's ``get_extra_state``, an optimizer whose
``state_dict`` transforms its values) is never cached and flattens anew each time.

Not seen: a parameter deleted with ``del module.name`` or written into a module's private
``_parameters`` dict, both of which bypass the registration hooks; both are followed by a new
optimizer (or a registration) in practice, which the check does see.
"""
from __future__ import annotations

import itertools
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .items import ObjectItem, TensorItem
from .placement import is_dtensor

_registrations = itertools.count()
_registration_count = [0]
_hooks_installed = False
# The modules of cached entries (with their submodules). Registrations on other modules do not
# count: slicing an nn.ModuleList (``self.layers[:n]``, as Hugging Face models do at every
# forward) registers the same layers into a new, temporary list.
_watched: weakref.WeakSet = weakref.WeakSet()


def _registered(module, *_args) -> None:
    if module in _watched:
        _registration_count[0] = next(_registrations) + 1


def _install_registration_hooks() -> None:
    """Count every parameter, buffer and submodule registration on a watched module (once)."""
    global _hooks_installed
    if _hooks_installed:
        return
    nn.modules.module.register_module_parameter_registration_hook(_registered)
    nn.modules.module.register_module_buffer_registration_hook(_registered)
    nn.modules.module.register_module_module_registration_hook(_registered)
    _hooks_installed = True


_values = operator.methodcaller("values")
_PLAIN = (torch.Tensor, nn.Parameter)  # no subclass: a type lookup instead of an isinstance per tensor


def signatures(tensors: list[torch.Tensor]) -> list[tuple]:
    """What must stay the same for a cached view of each tensor to still show its bytes."""
    with torch.no_grad():  # a DTensor's to_local() is then its own local tensor, no autograd view
        return [(id(t), t.data_ptr(), t.shape, t.stride(), t.dtype)
                if type(t) in _PLAIN or not is_dtensor(t) else _dtensor_signature(t) for t in tensors]


def _unmoved(live: list[torch.Tensor]) -> Callable[[], Any]:
    """A cheaper check of plain tensors than their signatures: whether each still shows the memory
    of an alias taken now (``is_set_to``: storage, offset, sizes and strides, one call that makes
    no Python object) in the same dtype, which ``.data =`` of a reinterpreting view would change."""
    with torch.no_grad():
        aliases = [t.detach() for t in live]
    dtypes = [t.dtype for t in live]
    unmoved = torch.Tensor.is_set_to
    dtype_of = operator.attrgetter("dtype")
    return lambda: all(map(unmoved, live, aliases)) and list(map(dtype_of, live)) == dtypes


def _dtensor_signature(t) -> tuple:
    local = t.to_local()
    return (id(t), t.placements, id(t.device_mesh), id(local), local.data_ptr(), local.shape, local.stride(),
            local.dtype)


def _alias_key(t: torch.Tensor) -> tuple:
    """Tensors with equal keys show the same bytes the same way (one is a view of the other)."""
    if is_dtensor(t):
        with torch.no_grad():
            t = t.to_local()
    return t.data_ptr(), t.shape, t.stride(), t.dtype


def _views_of(items: list[TensorItem], live: list[torch.Tensor]) -> bool:
    """Whether every item's tensor is one of ``live`` or a view of one, seen the same way."""
    keys = {_alias_key(t) for t in live}
    return all(_alias_key(item.local) in keys for item in items)


@dataclass(eq=False)
class _Entry:
    """One provider's items and what its check compares."""

    provider: Any  # held, so that its id is not reused by another object while cached
    tensors: list[TensorItem]
    names: frozenset  # every fqn it adds, claimed again at each reuse
    readers: list[tuple[str, bool, Callable[[], Any]]]  # plain values: (fqn, replicated, read now)
    fingerprint: Callable[[], Any]
    expected: Any
    depends_on: list["_Entry"] = field(default_factory=list)
    checked_in: int = -1  # the save whose check last ran
    valid: bool = False

    def still_valid(self, generation: int) -> bool:
        if self.checked_in != generation:
            self.checked_in = generation
            self.valid = all(d.still_valid(generation) for d in self.depends_on) and \
                self.fingerprint() == self.expected
        return self.valid

    def objects(self) -> list[ObjectItem]:
        return [ObjectItem(fqn, read(), replicated=replicated) for fqn, replicated, read in self.readers]


class ProviderCache:
    """The flattened items of the modules and optimizers of one saved state, by provider; held
    by whoever saves the same state repeatedly (a ``Checkpointer``). Entries of providers that a
    save did not meet are dropped after it."""

    def __init__(self):
        _install_registration_hooks()
        self._entries: dict[tuple[str, int], _Entry] = {}
        self._generation = 0
        self._used: set[tuple[str, int]] = set()
        self._context: tuple = ()

    def interned(self, context: tuple) -> tuple:
        """``context`` as the very tuple the entries hold where it equals the last save's: a lookup
        then finds it by identity (a state of thousands of modules in a list compared all of it
        once per module: quadratic, slower than not caching past a few thousand)."""
        if context != self._context:
            self._context = context
        return self._context

    def begin(self) -> None:
        self._generation += 1
        self._used = set()

    def end(self) -> None:
        for key in self._entries.keys() - self._used:
            del self._entries[key]

    def lookup(self, fqn: str, provider, context: tuple = ()) -> _Entry | None:
        """The entry of ``provider`` under ``fqn`` if its check passes now. ``context``: what
        else the entry was built from (the state's modules: their names and identities)."""
        key = (fqn, id(provider))
        self._used.add(key)
        entry = self._entries.get(key)
        if entry is None or (entry.expected[0] is not context and entry.expected[0] != context) \
                or not entry.still_valid(self._generation):
            return None
        return entry

    def store_module(self, fqn: str, module: nn.Module, tensors: list[TensorItem], objects: list[ObjectItem],
                     context: tuple = ()) -> None:
        """Keep a module's items when they are all views of its parameters and buffers."""
        live = list({id(t): t for t in itertools.chain(module.parameters(), module.buffers())}.values())
        if objects or not _views_of(tensors, live):
            return

        _watched.update(module.modules())
        tensors_unchanged = _unmoved(live) if all(type(t) in _PLAIN and t.layout == torch.strided for t in live) \
            else lambda: signatures(live)

        def fingerprint():
            return context, _registration_count[0], tensors_unchanged()

        self._store(fqn, module, _Entry(module, list(tensors), frozenset(i.fqn for i in tensors), [],
                                        fingerprint, fingerprint()))

    def store_optimizer(self, fqn: str, optim: torch.optim.Optimizer, owners: tuple[nn.Module, ...], sd: dict,
                        tensors: list[TensorItem], objects: list[ObjectItem], join: Callable[..., str],
                        context: tuple = ()) -> None:
        """Keep an optimizer's items (``sd``: the state dict they were flattened from, keyed by
        parameter name) when its tensors are its live state and its plain values can be read
        again from the live optimizer. Valid while the entries of ``owners`` are: the module whose
        parameter names key its state, or the modules of the state gathered to hold them (an
        encoder and a decoder under their own keys; ``context`` then holds their names)."""
        owner_entries = [self._entries.get((self._owner_fqn(module), id(module))) for module in owners]
        if None in owner_entries:
            return
        params = [p for group in optim.param_groups for p in group["params"]]
        names = [name for group in sd["param_groups"] for name in group["params"]]
        if len(names) != len(params):
            return
        param_of = dict(zip(names, params))
        group_names = [list(group["params"]) for group in sd["param_groups"]]

        def param_groups():
            return [{**{k: v for k, v in group.items() if k != "params"}, "params": list(group_names[i])}
                    for i, group in enumerate(optim.param_groups)]

        state_fqn = join(fqn, "state")
        readers: dict[str, Callable[[], Any]] = {join(fqn, "param_groups"): param_groups}
        for name, values in sd["state"].items():
            if name not in param_of:
                return
            param = param_of[name]
            if not values:
                readers[join(state_fqn, name)] = dict
            for key, value in values.items():
                if not isinstance(value, torch.Tensor):
                    readers[join(join(state_fqn, name), key)] = lambda p=param, k=key: optim.state[p][k]
        if not sd["state"]:
            readers[state_fqn] = dict
        if any(item.fqn not in readers or item.value != readers[item.fqn]() for item in objects):
            return  # a value the optimizer's state_dict makes otherwise than its live state holds it
        live = [v for p in params for v in optim.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        if not _views_of(tensors, live):
            return

        # Items that are the state's tensors themselves (not views of them) show whatever those
        # hold, even after ``.data =``: their identities are the check, which reads no tensor
        # (the signatures cost a microsecond per tensor). What identity misses, a shape or dtype
        # changed in place, the snapshot's copy refuses (checkpointer/pipeline.py).
        itself = {id(v) for v in live} >= {id(item.local) for item in tensors}

        def fingerprint():  # optim.state in its own order: looking parameters up would hash each
            states = list(optim.state.values())
            values = itertools.chain.from_iterable(map(_values, states))
            tensors_now = [v for v in values if isinstance(v, torch.Tensor)]
            described = list(map(id, tensors_now)) if itself else signatures(tensors_now)
            layout = [list(map(id, group["params"])) for group in optim.param_groups]
            return context, layout, list(map(id, optim.state)), list(map(tuple, states)), described

        entry = _Entry(optim, list(tensors), frozenset([*(i.fqn for i in tensors), *(o.fqn for o in objects)]),
                       [(o.fqn, o.replicated, readers[o.fqn]) for o in objects], fingerprint, fingerprint(),
                       depends_on=owner_entries)
        self._store(fqn, optim, entry)

    def _owner_fqn(self, owner: nn.Module) -> str:
        return next((fqn for (fqn, ident) in self._entries if ident == id(owner)), "")

    def _store(self, fqn: str, provider, entry: _Entry) -> None:
        entry.checked_in, entry.valid = self._generation, True
        self._entries[(fqn, id(provider))] = entry
        self._used.add((fqn, id(provider)))
