"""State providers: turn a user's ``state`` dict into tensor and object items, and back.

Modules and optimizers go through PyTorch's public ``torch.distributed.checkpoint.state_dict``
helpers, which strip DDP/FSDP wrappers from names and key optimizer state by parameter name, so
optimizer state reshards exactly like the parameters it belongs to.
"""
from __future__ import annotations

import bisect
import enum
import math
import operator
import sys
import traceback
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from ..errors import CheckpointError, StateMismatchError
from ..format import plaindata
from ..format.dtypes import flat_bytes
from ..format.plaindata import QUIET_NAN_BITS, float_bits, inlinable
from ..format.manifest import BOX
from .items import SEP, Flattened, ObjectItem, TensorItem, join, refuse_unwritable
from .module_state import load_module, model_state_dict, tie_origins
from .optim_state import (
    create_adam_state, create_state_from_checkpoint, group_members, load_optimizer_state, positional_holder,
    state_dict_by_a_step, state_dict_without_step, stored_param_names, stored_state_differs, with_members,
)
from .owners import Container, OwnerFinder
from .placement import dtensor_box, has_replicate, is_dtensor
from .reuse import ProviderCache
from .wrappers import PerRank, Replicated, Sharded


def _is_stateful(value) -> bool:
    try:
        return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
    except Exception:  # noqa: BLE001 (an attribute dict, whose __getattr__ is dict.__getitem__: a KeyError)
        return False


class StoredNames:
    """The names a checkpoint holds (sorted), as flattening a state for a load asks about them:
    whether it brings a fresh optimizer's state (else none is made for it) and what that state
    is, and whether it stored a list or tuple by index or whole. ``headers``: the ``(shape,
    dtype)`` of a stored tensor by name, None for a value stored inline; without it a fresh
    optimizer's state is made by a step (optim_state.py). ``plain``: a value stored as plain
    data by name, None for any other (an optimizer's param groups, checked before anything is
    read)."""

    def __init__(self, names: list[str], headers: Callable[[str], tuple | None] | None = None,
                 plain: Callable[[str], Any] | None = None):
        self._names = names
        self._headers = headers
        self._plain = plain

    @classmethod
    def of_manifest(cls, manifest, where: str = "") -> StoredNames:
        """``where``: the manifest, named by an error about a value read from it."""
        def header(name: str) -> tuple | None:
            row = manifest.header(name)
            return None if row is None else (row.shape, row.dtype)
        return cls(manifest.keys(), header, plain_values(manifest.objects, where))

    @property
    def has_headers(self) -> bool:
        return self._headers is not None

    def header(self, name: str) -> tuple | None:
        return self._headers(name)

    def plain(self, name: str) -> Any:
        return None if self._plain is None else self._plain(name)

    def has_prefix(self, prefix: str) -> bool:
        i = bisect.bisect_left(self._names, prefix)
        return i < len(self._names) and self._names[i].startswith(prefix)

    def keys_under(self, prefix: str) -> list[str]:
        """The rest of each name that starts with ``prefix``."""
        names, found = self._names, []
        i = bisect.bisect_left(names, prefix)
        while i < len(names) and names[i].startswith(prefix):
            found.append(names[i][len(prefix):])
            i += 1
        return found

    def holds(self, name: str) -> bool:
        i = bisect.bisect_left(self._names, name)
        return i < len(self._names) and self._names[i] == name


_EXTRA_STATE = "_extra_state"  # (the key ``Module.state_dict`` gives a module's get_extra_state())

_GROUPS_ADVICE = ("Build the optimizer with the param groups it was saved with, or leave it out of the state "
                  "(with partial=True) and start it afresh.")


def plain_values(objects: dict, where: str = "") -> Callable[[str], Any]:
    """``StoredNames``'s ``plain`` over ``objects`` (name -> ObjectEntry: a manifest's, a snapshot's)."""
    def plain(name: str) -> Any:
        entry = objects.get(name)
        return plaindata.decode(entry.value, name, where) if entry is not None and entry.kind == "json" else None
    return plain


class _Walker:
    def __init__(self, for_load: bool, stored: StoredNames | None, created: list[torch.Tensor] | None = None,
                 fresh: list[tuple] | None = None, cache: ProviderCache | None = None,
                 whole: bool = True):
        self.for_load = for_load
        self.whole = whole  # loads: strict and not partial (a stepped optimizer's state may be replaced)
        self.cache = cache  # saves only: items of modules and optimizers kept from the last save
        self.stored = stored or StoredNames([])  # loads: what the checkpoint holds
        self.created = created  # where a fresh optimizer's state goes when it is created unfilled
        self.fresh = fresh  # loads: (optimizer, its state before) of those it empties or finds empty (restore_emptied)
        self.out = Flattened([], [], [])
        self.seen: set[str] = set()
        self.modules: list[nn.Module] = []
        self.named_modules: list[tuple[str, nn.Module]] = []  # (fqn in the state, module)
        self.context: tuple = ()
        self.state: dict = {}
        # (the items' list, not a closure over the walker: that made a cycle, which kept every item,
        # entry and the manifest of a load alive until the collector next ran)
        self.filled = FilledPlaces(self.out.tensors)  # loads' plain values

    def _claim(self, fqn: str) -> None:
        if fqn in self.seen:
            raise CheckpointError(f"two entries of the state flatten to the same name {fqn!r}; rename one")
        self.seen.add(fqn)

    def run(self, state: dict) -> Flattened:
        if not isinstance(state, dict):
            raise CheckpointError(f"state must be a dict, not {type(state).__name__}")
        if self.cache is not None:
            self.cache.begin()
        try:
            self.state = state
            self.named_modules = list(_named_in_state(state))
            self.owners = OwnerFinder(self.named_modules, lambda: _named_in_state(state, kind=torch.Tensor))
            self.modules = [module for _, module in self.named_modules]
            # what cached items were built from: the state's modules, under their names (those of
            # an optimizer whose parameters several modules hold are the keys of the state)
            self.context = tuple((fqn, id(module)) for fqn, module in self.named_modules)
            if self.cache is not None:
                self.context = self.cache.interned(self.context)
            self.walk_dict("", state)
        except RecursionError:  # (Python's recursion limit: plain data of hundreds of levels, or a deep caller)
            inside_itself = _cycle_in(state)
            if inside_itself is not None:
                raise CheckpointError(f"the state holds itself: {inside_itself!r} is a dict, list or tuple that "
                                      "lies inside itself, which no checkpoint can store; break the cycle") from None
            depth = sum(1 for _ in traceback.walk_stack(None))
            raise CheckpointError(
                "the state nests lists, tuples and dicts too deeply (hundreds of levels) to be "
                f"{'loaded' if self.for_load else 'saved'} from {depth} calls deep, within Python's recursion limit "
                f"({sys.getrecursionlimit()}): store such a value flatter, e.g. as a JSON string, or call from a "
                "shallower stack") from None
        finally:
            if self.cache is not None:
                self.cache.end()
        return self.out

    def _reused(self, fqn: str, provider) -> bool:
        """Add the cached items of ``provider`` if its check passes (saves only)."""
        if self.cache is None:
            return False
        entry = self.cache.lookup(fqn, provider, self.context)
        if entry is None:
            return False
        if not self.seen.isdisjoint(entry.names):
            clash = sorted(self.seen & entry.names)[0]
            raise CheckpointError(f"two entries of the state flatten to the same name {clash!r}; rename one")
        self.seen.update(entry.names)
        self.out.tensors.extend(entry.tensors)
        self.out.objects.extend(entry.objects())
        return True

    def walk_dict(self, prefix: str, mapping: dict) -> None:
        for key, value in list(mapping.items()):
            self.walk(join(prefix, key), value, mapping, key)

    def walk(self, fqn: str, value: Any, container: Any, key: Any) -> None:
        if type(value) is torch.Tensor:  # (the commonest: a module's state dict holds them)
            self.tensor(fqn, value)
        elif isinstance(value, nn.Module):
            self.module(fqn, value)
        elif isinstance(value, torch.optim.Optimizer):
            self.optimizer(fqn, value)
        elif isinstance(value, PerRank):
            self._claim(fqn)
            self.out.objects.append(ObjectItem(fqn, value.snapshot(), per_rank=value))
        elif isinstance(value, Replicated):
            self.declare_replicated(lambda: self.walk(fqn, value.value, container, key))
        elif isinstance(value, Sharded):
            self._claim(fqn)
            self.out.tensors.append(TensorItem(fqn, value.local, value.global_shape, value.layout,
                                               value.start, value.size))
        elif isinstance(value, torch.Tensor):
            self.tensor(fqn, value)
        elif isinstance(value, dict) and value and (type(value) is dict or not _is_stateful(value)):
            # (a dict subclass with a state_dict is stateful, below: its state may lie outside its items)
            self.walk_dict(fqn, value)
        elif isinstance(value, (list, tuple)) and self._walks_sequence(fqn, value):
            # Some state_dicts hold lists of large tensors (or of dicts of them, of modules): walk
            # them by index, like dicts, so the tensors go to data files (small ones, like RNG
            # states, stay inline plain data).
            for index, element in enumerate(value):
                self.walk(join(fqn, index), element, value, index)
        elif _is_stateful(value):
            sd = value.state_dict()
            if not isinstance(sd, Mapping):  # (walk_dict would fail with "'list' object has no attribute 'items'")
                raise CheckpointError(f"{fqn}: state_dict() of the {type(value).__name__} returned a "
                                      f"{type(sd).__name__}, not a dict; statesnap stores a state dict by its keys. "
                                      "Return a dict (e.g. {'value': ...}), or put the value itself in the state")
            if isinstance(value, dict) and self._stored_by_items(fqn, sd, value):
                self.walk_dict(fqn, value)
                return
            first_object = len(self.out.objects)
            self.walk_dict(fqn, sd)
            self._owned_since(first_object)
            if self.for_load:
                self.out.finalizers.append(lambda v=value, sd=sd: v.load_state_dict(sd))
        else:
            self._claim(fqn)
            assign, check = _assigner(fqn, container, key, self.filled)
            self.out.objects.append(ObjectItem(fqn, value, assign=assign, check=check))

    def _stored_by_items(self, fqn: str, sd: Mapping, mapping: dict) -> bool:
        """A load of a dict with a state_dict from a checkpoint that holds its items, as statesnap
        stored such a dict before it saved one through its state_dict: nothing under the state
        dict's keys, something under the items'."""
        def stored(key) -> bool:
            return self.stored.holds(join(fqn, key)) or self.stored.has_prefix(join(fqn, key) + SEP)
        return self.for_load and not any(map(stored, sd)) and any(map(stored, mapping))

    def _walks_sequence(self, fqn: str, value: list | tuple) -> bool:
        """A save walks a list or tuple that holds what plain data cannot (``_needs_walk``). A
        load walks a list holding a large tensor, as statesnap always did (a checkpoint that
        stored it otherwise is then a mismatch), and other sequences where the checkpoint did:
        one saved whole (pickled, before such sequences were walked) loads as the one value it is."""
        if not self.for_load:
            return _needs_walk(value)
        if isinstance(value, list) and any(isinstance(v, torch.Tensor) and not inlinable(v) for v in value):
            return True
        return self.stored.has_prefix(join(fqn, "")) and not self.stored.holds(fqn)  # (under a top-level "": "0")

    def tensor(self, fqn: str, value: torch.Tensor) -> None:
        self._claim(fqn)
        if type(value) is not torch.Tensor and is_dtensor(value):
            box = dtensor_box(value, fqn)
            if box is None:
                return
            item = TensorItem(fqn, value.to_local(), tuple(value.shape), BOX, *box, replicated=has_replicate(value),
                              origin=value)
        else:
            # A plain tensor under several ranks is a replica (DDP): identical boxes dedup on save.
            item = TensorItem(fqn, value)
        if self.for_load:
            refuse_unwritable(item)
        self.out.tensors.append(item)

    def module(self, fqn: str, module: nn.Module) -> None:
        if self._reused(fqn, module):
            return
        first_tensor, first_object = len(self.out.tensors), len(self.out.objects)
        sd = model_state_dict(module)
        if self.for_load:
            self._fit_extra_states(fqn, sd)
        # Buffers are not compared across ranks: unsynchronised BatchNorm statistics differ between
        # DDP, FSDP and TP ranks by design, and one copy is what DDP (which broadcasts rank 0's at
        # the next forward), DCP and torch.save keep. Parameters are compared.
        inner = module.module if isinstance(module, DistributedDataParallel) else module
        buffers = {join(fqn, name) for name, _ in inner.named_buffers()}
        self.declare_replicated(lambda: self.walk_dict(fqn, sd), buffers)
        self._owned_since(first_object)
        if self.for_load:
            tie_origins(inner, fqn, self.out.tensors[first_tensor:])
            self.out.finalizers.append(lambda: load_module(module, sd))
        elif self.cache is not None:
            self.cache.store_module(fqn, module, self.out.tensors[first_tensor:], self.out.objects[first_object:],
                                    self.context)

    def _fit_extra_states(self, fqn: str, sd: dict) -> None:
        """A module's extra state held as a tensor takes the stored shape and dtype: it is handed to
        ``set_extra_state``, which takes any, as ``load_state_dict`` does. Transformer Engine keeps
        its FP8 metadata as a uint8 tensor of pickled bytes, empty in a fresh module: a resume
        into a model just built was refused as a shape mismatch."""
        for key, value in sd.items():
            if not (type(value) is torch.Tensor and str(key).rpartition(SEP)[2] == _EXTRA_STATE):
                continue
            header = self.stored.header(join(fqn, key)) if self.stored.has_headers else None
            if header is not None and (tuple(header[0]) != tuple(value.shape) or header[1] != value.dtype):
                sd[key] = torch.empty(header[0], dtype=header[1], device=value.device)

    def declare_replicated(self, walk: Callable[[], None], names: set[str] | None = None) -> None:
        """Run ``walk`` and mark the items it adds (those in ``names``, if given) as declared
        replicated: saves do not compare their copies across ranks."""
        first_tensor, first_object = len(self.out.tensors), len(self.out.objects)
        walk()
        for item in [*self.out.tensors[first_tensor:], *self.out.objects[first_object:]]:
            if names is None or item.fqn in names:
                item.replicated = True

    def _owned_since(self, first_object: int) -> None:
        """The plain values added since ``first_object`` are put back by their owner's
        ``load_state_dict`` (engine/objects.py ``fitted_to_held`` leaves them to it)."""
        for item in self.out.objects[first_object:]:
            item.owned = True

    def optimizer(self, fqn: str, optim: torch.optim.Optimizer) -> None:
        # Pipeline stages list different parameters in their param groups; the groups are kept
        # from rank 0 (docs/resharding.md), so they are not compared across ranks.
        groups = {join(fqn, "param_groups")}
        if self._reused(fqn, optim):
            return
        if type(optim).__name__ == "ZeroRedundancyOptimizer":  # (its state_dict() fails but on one rank)
            raise CheckpointError(f"{fqn}: a ZeroRedundancyOptimizer's state dict is collected on one rank only; "
                                  "put this rank's own optimizer in the state instead (its .optim: it loads on "
                                  "as many ranks), or shard with fully_shard (FSDP2) or ss.flat_partition")
        if self.for_load:
            self._refuse_other_groups(fqn, optim)
        if self.fresh is not None and not optim.state:
            self.fresh.append((optim, {}))
        model = self.owners.owner_of(optim)
        if model is not None and self.for_load and self._saved_by_position(fqn, model):
            model = None  # saved by position, as statesnap did before it named such optimizers' state
        state_to_fill = self.for_load and self.stored.has_prefix(join(fqn, "state") + SEP)
        fresh = not optim.state and state_to_fill
        if model is None:
            # No module in the state owns these parameters: fall back to positional state.
            sd = self._fresh_state(optim, fqn, optim.state_dict, by_position=True) if fresh else None
            if sd is None:
                if fresh and not optim.state:  # a kind whose state only its step makes
                    state_dict_by_a_step(positional_holder(optim), optim, fqn)
                sd = optim.state_dict()
                if not fresh:
                    sd = self._replaced(fqn, optim, sd, optim.state_dict, optim.state_dict, by_position=True) or sd
            self._refuse_regrouped(fqn, sd)
            held = group_members(sd)
            first_object = len(self.out.objects)
            self.declare_replicated(lambda: self.walk_dict(fqn, sd), groups)
            self._owned_since(first_object)
            if self.for_load:
                self.out.finalizers.append(lambda: optim.load_state_dict(with_members(sd, held)))
            return
        sd = self._fresh_state(optim, fqn, lambda: get_optimizer_state_dict(model, optim)) if fresh else None
        if sd is None:
            if optim.state:  # (had it, or Adam's was just made)
                sd = get_optimizer_state_dict(model, optim)
                if not fresh:
                    sd = self._replaced(fqn, optim, sd, lambda: get_optimizer_state_dict(model, optim),
                                        lambda: state_dict_without_step(model, optim)) or sd
            elif state_to_fill:  # a kind whose state only its step makes
                sd = state_dict_by_a_step(model, optim, fqn)
            else:
                sd = state_dict_without_step(model, optim)
        self._refuse_regrouped(fqn, sd)
        held = group_members(sd)
        first_tensor, first_object = len(self.out.tensors), len(self.out.objects)
        self.declare_replicated(lambda: self.walk_dict(fqn, sd), groups)
        self._owned_since(first_object)
        if self.for_load:
            self.out.finalizers.append(lambda: load_optimizer_state(model, optim, with_members(sd, held)))
        elif self.cache is not None:
            owners = model.gathered if isinstance(model, Container) and model.gathered else (model,)
            self.cache.store_optimizer(fqn, optim, owners, sd, self.out.tensors[first_tensor:],
                                       self.out.objects[first_object:], join, self.context)

    def _replaced(self, fqn: str, optim: torch.optim.Optimizer, sd: dict, state_dict: Callable[[], dict],
                  without_state: Callable[[], dict], by_position: bool = False) -> dict | None:
        """A load replaces a stepped optimizer's state as a whole, as its ``load_state_dict`` does,
        where the checkpoint keeps other state for the parameters its own param groups list
        (``stored_state_differs``: a run rolled back past a layer's unfreezing, a checkpoint saved
        before the first step, LBFGS's ``H_diag``): the state is set aside and made from the
        checkpoint's names, as for a fresh optimizer, and goes back if the load fails. Returns the
        state dict of the state made, or None where the optimizer keeps its own: the load is of
        what matches (``strict=False``, ``partial=True``: it leaves what differs as it was), or
        the checkpoint holds nothing of it, lists none of its parameters (other names), or keeps
        state of another kind, which the load then names as a mismatch."""
        if not self.for_load or not self.whole or self.fresh is None or not optim.state:
            return None
        listed = stored_param_names(self.stored.plain(join(fqn, "param_groups")))
        prefix = join(fqn, "state") + SEP
        if not listed or not stored_state_differs(optim, sd, prefix, self.stored, listed):
            return None
        before = dict(optim.state)
        optim.state.clear()
        made = create_state_from_checkpoint(optim, state_dict, prefix, self.stored, self.created, by_position)
        if made is None and not self.stored.has_prefix(prefix):
            made = without_state()  # (saved before its first step: it had none)
        if made is None:
            optim.state.update(before)
            return None
        self.fresh.append((optim, before))
        return made

    def _refuse_other_groups(self, fqn: str, optim: torch.optim.Optimizer) -> None:
        """A checkpoint's optimizer of another number of param groups cannot be loaded: PyTorch's
        helper maps the stored groups' hyperparameters by parameter name, so a group no stored one
        names was left without any (a bare ``KeyError: 'lr'`` at the next step) and one that
        several name took the last one's (a weight decay of 0 for every parameter). Refused by
        name, before anything is read."""
        stored = self.stored.plain(join(fqn, "param_groups"))
        if isinstance(stored, list) and len(stored) != len(optim.param_groups):
            raise StateMismatchError(
                f"{fqn}: the checkpoint's optimizer has {len(stored)} param group(s), this one "
                f"{len(optim.param_groups)}; their hyperparameters (lr, weight decay, ...) would go to other "
                "parameters or to none.", mismatched=[join(fqn, "param_groups")],
                advice=_GROUPS_ADVICE)

    def _refuse_regrouped(self, fqn: str, sd: dict) -> None:
        """The same parameters grouped otherwise (as many groups, other members) cannot be loaded
        either: each group's hyperparameters would go to the parameters of another (the weight
        decay of the layers to the biases), or a group would get none. Compared by the names (or
        positions) in the groups of ``sd``, the optimizer's state dict as this load fills it, over
        the parameters both hold: a pipeline stage's groups list its own parameters, while the
        checkpoint keeps rank 0's (docs/resharding.md), and an optimizer may hold a parameter the
        checkpoint's did not (one unfrozen since), which must not hide a regrouping of the others."""
        if not self.for_load:
            return
        stored = self.stored.plain(join(fqn, "param_groups"))
        held = [set(group.get("params", ())) for group in sd.get("param_groups", ())]
        try:
            kept = [set(group["params"]) for group in stored]
        except (TypeError, KeyError):  # (malformed groups: the load names them when it fills them)
            return
        shared = set().union(*kept) & set().union(*held)  # (a pipeline stage may share none with rank 0)
        if len(kept) != len(held) or not shared or all(k & shared == h & shared for k, h in zip(kept, held)):
            return
        moved = sorted({str(p) for k, h in zip(kept, held) for p in (k ^ h) & shared})
        raise StateMismatchError(
            f"{fqn}: the checkpoint's optimizer groups its parameters otherwise than this one ({', '.join(moved[:4])}"
            f"{' and more' if len(moved) > 4 else ''} lie in another param group); their hyperparameters (lr, "
            "weight decay, ...) would go to other parameters or to none.", mismatched=[join(fqn, "param_groups")],
            advice=_GROUPS_ADVICE)

    def _fresh_state(self, optim: torch.optim.Optimizer, fqn: str, state_dict: Callable[[], dict],
                     by_position: bool = False) -> dict | None:
        """Make a fresh optimizer's state for the load without a step, where its kind allows:
        what the checkpoint holds for it (its state dict is returned), else (Adam's of other
        keys: a mismatch the load then names) what its first step would make."""
        sd = create_state_from_checkpoint(optim, state_dict, join(fqn, "state") + SEP, self.stored, self.created,
                                          by_position)
        if sd is None:
            create_adam_state(optim, self.created)
        return sd

    def _saved_by_position(self, fqn: str, owner: nn.Module) -> bool:
        """Whether the checkpoint keys optimizer ``fqn``'s state by position: some under
        ``<fqn>.state.0.``, and its param groups list integers (names are strings), or, where
        they list none, nothing under a parameter name of ``owner`` (which may start with a
        digit too: a Sequential, modules under digit keys). Names as PyTorch's helper gives
        them, without the wrappers' parts (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``):
        those are looked up only when the plain names are not found, as building them costs a
        state dict."""
        state = join(fqn, "state")
        if not self.stored.has_prefix(join(state, 0) + SEP):
            return False
        groups = self.stored.plain(join(fqn, "param_groups"))
        listed = [p for g in groups for p in g.get("params", ())] if isinstance(groups, list) and all(
            isinstance(g, dict) and isinstance(g.get("params", ()), list) for g in groups) else []
        if listed:  # (a parameter named "0", {0: p, ...}, is stored under "0" either way)
            return all(type(p) is int for p in listed)
        if any(self.stored.has_prefix(join(state, name) + SEP) for name, _ in owner.named_parameters()):
            return False
        return not any(self.stored.has_prefix(join(state, name) + SEP) for name in model_state_dict(owner))

_SCALARS = {int, float, str, bool, type(None)}


def _cycle_in(state: dict) -> str | None:
    """The name at which a dict, list or tuple of ``state`` is met again inside itself, or None.
    (A depth-first walk that never enters a container twice: one shared by many is looked at once.)"""
    on_path, done = set(), set()
    stack: list[tuple[Any, str, bool]] = [(state, "", False)]
    while stack:
        value, fqn, leaving = stack.pop()
        if leaving:
            on_path.discard(id(value))
            done.add(id(value))
            continue
        if id(value) in on_path:
            return fqn
        if id(value) in done:
            continue
        on_path.add(id(value))
        stack.append((value, fqn, True))
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            if isinstance(item, (dict, list, tuple)):
                stack.append((item, join(fqn, key), False))
    return None


def _needs_walk(value: Any) -> bool:
    """Whether ``value`` holds, at any depth of lists, tuples and dicts, what plain data cannot:
    a tensor too large (or not plain enough) to be inlined, a module, an optimizer, a wrapper or
    another object with a state dict."""
    if isinstance(value, torch.Tensor):
        return not inlinable(value)
    if isinstance(value, (list, tuple, dict)):
        values = value.values() if isinstance(value, dict) else value
        if set(map(type, values)) <= _SCALARS:  # (a long list of numbers: one pass in C)
            return False
        return any(_needs_walk(v) for v in values if type(v) not in _SCALARS)
    return isinstance(value, (nn.Module, torch.optim.Optimizer, PerRank, Replicated, Sharded)) or _is_stateful(value)


def _assigner(fqn: str, container: Any, key: Any,
              filled: FilledPlaces) -> tuple[Callable[[Any], None], Callable[[Any], None] | None]:
    """How a load puts a plain value back at ``container[key]``, and the check it runs on the
    value before it writes anything (None: any value goes). A value is filled into what is held
    there where it can be (``_merged``), since a load is in place and others may hold the objects
    (an optimizer the small tensors of a list). A tuple cannot take a new value: what it holds
    must be filled in place or already be the stored value."""
    if not isinstance(container, tuple):
        return lambda v: container.__setitem__(key, _merged(container[key], v, filled)), None

    def check(value: Any) -> None:
        if not _fits_in_place(container[key], value):
            raise _tuple_refuses(fqn, container[key], value)

    def fill(value: Any) -> None:  # (checked before; a place also filled under another name is still refused here)
        held = container[key]
        merged = _merged(held, value, filled)
        if merged is not held and not _same(held, value) and not _same(held, merged):
            raise _tuple_refuses(fqn, held, value)
    return fill, check


def _tuple_refuses(fqn: str, held: Any, value: Any) -> StateMismatchError:
    """A mismatch of the state, not damage: no other copy of the checkpoint would fit it either."""
    return StateMismatchError(f"{fqn} lies in a tuple, which a load cannot change, and the checkpoint holds another "
                              f"value there ({_shown(value):.80} against {_shown(held):.80}).", mismatched=[fqn],
                              advice="Make the tuple a list.")


def _fits_in_place(held: Any, value: Any) -> bool:
    """Whether ``_merged`` keeps ``held`` when given ``value``, or ``value`` equals it: what a
    tuple's element needs. Asked without filling anything."""
    if isinstance(held, torch.Tensor) and isinstance(value, torch.Tensor):
        return (held.shape == value.shape and held.dtype == value.dtype) or _same(held, value)
    if isinstance(held, list) and isinstance(value, list) or isinstance(held, dict) and isinstance(value, dict):
        return True
    if isinstance(held, tuple) and isinstance(value, tuple) and len(held) == len(value):
        return all(map(_fits_in_place, held, value))
    if isinstance(held, bytearray) and isinstance(value, bytes):
        return True
    if isinstance(held, enum.Enum) and not isinstance(value, enum.Enum):
        try:
            return type(held)(value) is held
        except ValueError:
            return False
    if type(value) in (int, float, str, bytes) and isinstance(held, type(value)) and not isinstance(held, bool):
        return _same(type(value)(held), value)  # (numpy's float64 is a float: the value it holds is what counts)
    return _same(held, value)


class FilledPlaces:
    """What a load has filled in place so far, over the whole state: the lists and dicts, and
    the bytes of the tensors (by device, sorted, none overlapping another; by device, not
    storage: two ``torch.from_numpy`` views of one array are two storages over one memory),
    the data files' targets among them. One place cannot hold two stored values, so a place
    filled before is given its stored value as a new object instead (a list held under two
    names, as a fresh ``SequentialLR``'s ``_last_lr`` and its first scheduler's; ``[t] * n``; a
    tensor that is also a data file's target): each name then holds what was stored for it,
    where filling both left the last one's value in both, without a word."""

    def __init__(self, items: list):
        self._items = items  # the state's tensor items, read once a tensor is filled: all are known by then
        self._spans: dict[str, list[tuple[int, int]]] | None = None
        self._containers: set[int] = set()

    def first_time(self, held: list | dict) -> bool:
        """Whether ``held`` is filled for the first time (it is then recorded)."""
        if id(held) in self._containers:
            return False
        self._containers.add(id(held))
        return True

    def take(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes overlap none filled before (they are then recorded)."""
        if self._spans is None:
            self._spans = _merged_spans([item.local for item in self._items])
        span, spans = address_range(t), self._spans.setdefault(str(t.device), [])
        at = bisect.bisect_left(spans, span)  # only its neighbours in address order can overlap it
        if (at > 0 and spans[at - 1][1] > span[0]) or (at < len(spans) and spans[at][0] < span[1]):
            return False
        if span[1] > span[0]:
            spans.insert(at, span)
        return True


def _merged_spans(tensors: list[torch.Tensor]) -> dict[str, list[tuple[int, int]]]:
    """The address ranges of ``tensors`` by device, sorted, overlapping ones joined (tied weights)."""
    by_device: dict[str, list[tuple[int, int]]] = {}
    for t in tensors:
        span = address_range(t)
        if span[1] > span[0]:
            by_device.setdefault(str(t.device), []).append(span)
    for device, spans in by_device.items():
        joined: list[tuple[int, int]] = []
        for start, end in sorted(spans):
            if joined and start < joined[-1][1]:
                joined[-1] = (joined[-1][0], max(end, joined[-1][1]))
            else:
                joined.append((start, end))
        by_device[device] = joined
    return by_device


def _shown(value: Any) -> str:
    """``repr`` that tells NaNs apart by their bits, as ``_same`` does."""
    if isinstance(value, float) and math.isnan(value):
        return f"nan:{float_bits(value):016x}"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_shown, value)) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


def _merged(held: Any, value: Any, filled: FilledPlaces) -> Any:
    """``value`` put into ``held`` in place as far as it goes: a tensor of the same shape and
    dtype is copied into, a list or dict keeps its object (a list of another length, or a dict,
    takes the stored elements, each merged with the one it replaces); anything else is the
    stored value itself, which the caller puts in its place. Plain data keeps no class: a
    stored namedtuple or enum member is a tuple or its value, given back as the held one's class
    (a held ``IntEnum`` stayed an int after a load). A place ``filled`` before is replaced, not
    filled again (:class:`FilledPlaces`); views of one buffer that do not overlap are each filled."""
    if isinstance(held, torch.Tensor) and isinstance(value, torch.Tensor):
        if held.shape != value.shape or held.dtype != value.dtype or not filled.take(held):
            return value
        try:
            with torch.no_grad():
                held.copy_(value)
        except RuntimeError:  # one that cannot be written (an inference tensor): replaced
            return value
        return held
    if isinstance(held, (list, dict)) and isinstance(value, (list, dict)) and not filled.first_time(held):
        return value
    if isinstance(held, list) and isinstance(value, list):
        held[:] = [_merged(h, v, filled) for h, v in zip(held, value)] + value[len(held):]
        return held
    if isinstance(held, dict) and isinstance(value, dict):  # (an OrderedDict or defaultdict stays one)
        merged = {k: _merged(held[k], v, filled) if k in held else v for k, v in value.items()}
        held.clear()
        held.update(merged)
        return held
    if isinstance(held, torch.Size) and isinstance(value, tuple) and all(type(n) is int for n in value):
        return torch.Size(value)  # (stored as a tuple, of any length)
    if isinstance(held, tuple) and isinstance(value, tuple) and len(held) == len(value):
        merged = tuple(_merged(h, v, filled) for h, v in zip(held, value))
        if all(map(operator.is_, merged, held)):
            return held
        return type(held)._make(merged) if hasattr(type(held), "_make") else merged  # (a namedtuple)
    if isinstance(held, enum.Enum) and not isinstance(value, enum.Enum):
        try:
            return type(held)(value)  # the member of that value
        except ValueError:  # none: the stored value itself
            return value
    if isinstance(held, bytearray) and isinstance(value, bytes):  # (stored as bytes)
        held[:] = value
        return held
    if type(value) in (int, float, str, bytes) and type(held) is not type(value) and isinstance(held, type(value)) \
            and not isinstance(held, bool):
        try:  # a subclass of the stored type (numpy's float64 is a float): the same value in it
            same = type(held)(value)
        except Exception:  # noqa: BLE001 (one that is not made so)
            return value
        return same if _same(type(value)(same), value) else value
    return value


def address_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a tensor's elements lie in, first to last (an empty tensor: none)."""
    if t.numel() == 0:
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _same(held: Any, stored: Any) -> bool:
    """Equal values, looking inside tuples (a named tuple comes back as a plain one). Floats are
    compared bit for bit: NaN equals the NaN of the same bits (a value saved is the value loaded),
    and -0.0 is not 0.0, which ``==`` would let a tuple keep in place of the stored one. A stored
    NaN of ``math.nan``'s bits equals any NaN: writers before the tag ``nan:<bits>`` (format/
    plaindata.py) wrote every NaN so."""
    if isinstance(held, tuple) and isinstance(stored, tuple):
        return len(held) == len(stored) and all(map(_same, held, stored))
    if type(held) is not type(stored):
        return False
    if isinstance(held, float):
        if math.isnan(stored) and float_bits(stored) == QUIET_NAN_BITS:
            return math.isnan(held)
        return float_bits(held) == float_bits(stored)
    if isinstance(held, torch.Tensor):  # (== of one-element tensors of two dtypes is True)
        return same_bits(held, stored)
    try:
        return bool(held == stored)
    except Exception:  # noqa: BLE001 (values whose comparison is ambiguous or raises)
        return False


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have one dtype and shape and hold the same bytes (NaN payloads and
    -0.0 included), compared where ``a`` lives, eight bytes at a time where both allow it (a
    byte at a time is several times slower on large tensors)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    x, y = _raw_bytes(a), _raw_bytes(b.to(a.device))
    if x.numel() % 8 == 0 and x.storage_offset() % 8 == 0 and y.storage_offset() % 8 == 0:
        x, y = x.view(torch.int64), y.view(torch.int64)
    return torch.equal(x, y)


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return flat_bytes(t.detach().resolve_conj().resolve_neg().contiguous())


def _named_in_state(state: dict | list | tuple, prefix: str = "", kind: type = nn.Module):
    """The modules (or other values of ``kind``) of the state under their names in it, in dicts,
    lists and tuples (a list of modules is walked by index: ``models.0.weight``), not inside
    them. Only containers and such values are named, so a long list of plain values costs one
    type check per element at each save."""
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for key, value in items:
        if isinstance(value, kind):
            yield join(prefix, key), value
        elif isinstance(value, (dict, list, tuple)) and value:
            yield from _named_in_state(value, join(prefix, key), kind)


def flatten_for_save(state: dict, cache: ProviderCache | None = None) -> Flattened:
    """``cache``: kept by a caller that saves the same state repeatedly; the items of its modules
    and optimizers are then reused while their tensors are the same (``reuse.py``)."""
    return _Walker(for_load=False, stored=None, cache=cache).run(state)


def flatten_for_load(state: dict, stored: StoredNames, created: list[torch.Tensor] | None = None,
                     fresh: list[tuple] | None = None, whole: bool = True) -> Flattened:
    """``created``: a list that takes the tensors of fresh optimizer state created unfilled
    (``torch.empty``); the caller must fill or zero each. Without it they are zeroed.
    ``fresh``: a list that takes ``(optimizer, its state before)`` of the optimizers that had no
    state, or whose state the load replaces, as they are met (``restore_emptied`` puts it back).
    ``whole``: the load restores the whole state (strict, not partial), so that a stepped
    optimizer's state may be replaced (``_Walker._replaced``); a load of what matches leaves it."""
    return _Walker(for_load=True, stored=stored, created=created, fresh=fresh, whole=whole).run(state)
