"""What ``Checkpointer.save`` derives from the flattened state, kept while the state keeps its layout.

``save()`` should only record what to copy. Flattening a model and its optimizer, describing
every tensor for the plan, finding which optimizer writes which tensor and sizing the snapshot
cost tens of microseconds per tensor, tens of milliseconds per save for a thousand tensors, and
give the same answers step after step. ``StateCache`` keeps them: the flattened items of modules
and optimizers come from a :class:`~statesnap.state.reuse.ProviderCache` (which checks the live
tensors), and what is derived from those items is reused while the items are the very same
objects and the optimizers that own them are the same, with the same parameters and state.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from ..format.dtypes import dtype_name
from ..plan.save_plan import ALIGN
from ..state.flatten import flatten_for_save
from ..state.items import Flattened, ItemMeta, TensorItem
from ..state.placement import is_dtensor
from ..state.reuse import ProviderCache
from ..storage.base import DIRECT_ALIGN
from .hooks import owners_of, storage_of, version_of
from .staging import align_up


@dataclass
class Layout:
    """Per tensor item: its description for the plan and the optimizer that writes it."""

    items: list[TensorItem]
    optimizers: tuple
    metas: list[ItemMeta]
    owners: list
    owner_keys: dict  # optimizer id -> its owner (hooks.owners_of)
    snapshot_bytes: int  # arena bytes a snapshot may need (see Checkpointer._snapshot)
    on_cuda: bool
    plain: bool  # no DTensor or inference tensor: each item's ``_version`` is its counter
    # derived once, not at every save: the items no optimizer writes, their bytes, the optimizers
    # that write some item (by id), the bytes of all items, and what Snapshot.release looks at
    # again: each optimizer's items on the CPU (a GPU's version counter moves when an operation
    # is queued, so the check after its copy is exact)
    late_checks: dict = field(init=False)
    unguarded: list[int] = field(init=False)
    unguarded_bytes: int = field(init=False)
    writers: frozenset = field(init=False)
    nbytes: int = field(init=False)
    # per item: no conjugate or negative bit (a lazily conjugated or negated view, whose memory
    # does not hold its values); a tensor keeps its bits, and a layout its tensors
    resolved: list = field(init=False)

    def __post_init__(self):
        by_owner: dict = {}  # owner (hooks.owners_of; None: no optimizer) -> the indices of its items
        for index, owner in enumerate(self.owners):
            by_owner.setdefault(owner, []).append(index)
        self.unguarded = by_owner.pop(None, [])
        self.late_checks = {owner: [i for i in indices if self.items[i].local.is_cpu]
                            for owner, indices in by_owner.items()}
        self.unguarded_bytes = sum(self.metas[index].nbytes for index in self.unguarded)
        self.writers = frozenset(by_owner)
        self.nbytes = sum(meta.nbytes for meta in self.metas)
        self.resolved = [not (item.local.is_conj() or item.local.is_neg()) for item in self.items]

    def versions(self, tensors: list[torch.Tensor]) -> list:
        """Every tensor's version counter now, which the copy compares (``hooks.check_unchanged``)."""
        if self.plain:
            return [t._version for t in tensors]
        return [version_of(t) for t in tensors]

    def storages(self, tensors: list[torch.Tensor]) -> list[int]:
        """Where every tensor's values lie now, which the copy compares too."""
        if self.plain:
            return [t.data_ptr() for t in tensors]
        return [storage_of(t) for t in tensors]


def _optimizers_key(optimizers: list) -> tuple:
    """What the owners of tensors depend on: each optimizer, its parameters and its state's size."""
    return tuple((id(o), len(o.state), tuple(id(p) for group in o.param_groups for p in group["params"]))
                 for o in optimizers)


class StateCache:
    """The flattened state and its layout, rebuilt only where the state changed."""

    def __init__(self, reuse: bool = True):
        """``reuse=False`` flattens and derives everything anew at each save (the bench's baseline)."""
        self._providers = ProviderCache() if reuse else None
        self._layout: Layout | None = None
        self._stale = False
        self._unguarded_versions: dict[tuple, int | None] = {}  # (fqn, address) -> counter at the last save
        self._changing: set[str] = set()  # names of unguarded items seen changing between saves

    def forget(self) -> None:
        """Drop everything cached at the next save (callable from any thread): a snapshot found a
        tensor whose shape or dtype no longer matches the cached layout."""
        self._stale = True

    def flatten(self, state: dict) -> Flattened:
        if self._stale:
            self._stale = False
            self._providers = ProviderCache() if self._providers is not None else None
            self._layout = None
        return flatten_for_save(state, self._providers)

    def changed_unguarded(self, layout: Layout, flat: Flattened, versions: list) -> frozenset:
        """The items no optimizer writes that change in place between saves: those whose version
        counter moved since the last save, and from then on always (an EMA updated every few
        steps is one), and at the first save all of them. No hook holds back their changes: on
        the CPU, where PyTorch moves a version counter when an in-place operation ends, one still
        running while the lazy copy is checked would go unseen; on a GPU the check sees every
        change queued after ``save()``, but a BatchNorm's statistics change in the very next
        forward, so without the wait every checkpoint failed. Frozen weights never change, and
        stay lazy. Tensors are known by name and address: a state dict made anew for every save
        holds new tensor objects of the same memory."""
        previous, self._unguarded_versions = self._unguarded_versions, {}
        changed = []
        for index in layout.unguarded:
            item = flat.tensors[index]
            key = (item.fqn, item.local.data_ptr())
            self._unguarded_versions[key] = versions[index]
            if item.fqn in self._changing or versions[index] is None or previous.get(key, -1) != versions[index]:
                if key in previous:  # (not at the first save: there every one is waited for once)
                    self._changing.add(item.fqn)
                changed.append(index)
        return frozenset(changed)

    def layout(self, flat: Flattened, optimizers: list) -> Layout:
        items, key, cached = flat.tensors, _optimizers_key(optimizers), self._layout
        if self._providers is not None and cached is not None and cached.optimizers == key and \
                len(cached.items) == len(items) and all(map(operator.is_, cached.items, items)):
            return cached
        metas = [item.meta(dtype_name(item.dtype)) for item in items]
        # Each item may sit up to a block further on in the arena, at its file offset's distance
        # from a block boundary (direct I/O).
        self._layout = Layout(list(items), key, metas, *owners_of([item.local for item in items], optimizers),
                              sum(align_up(m.nbytes, ALIGN) + DIRECT_ALIGN for m in metas),
                              any(item.local.device.type == "cuda" for item in items),
                              not any(is_dtensor(item.local) or item.local.is_inference() for item in items))
        return self._layout

