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
from dataclasses import dataclass

import torch

from ..format.dtypes import dtype_name
from ..plan.save_plan import ALIGN
from ..state.flatten import flatten_for_save
from ..state.items import Flattened, ItemMeta, TensorItem
from ..state.placement import is_dtensor
from ..state.reuse import ProviderCache
from ..storage.base import DIRECT_ALIGN
from .hooks import owners_of, version_of
from .staging import align_up


@dataclass
class Layout:
    """Per tensor item: its description for the plan and the optimizer that writes it."""

    items: list[TensorItem]
    optimizers: tuple
    metas: list[ItemMeta]
    owners: list
    snapshot_bytes: int  # arena bytes a snapshot may need (see Checkpointer._snapshot)
    on_cuda: bool
    plain: bool  # no DTensor or inference tensor: each item's ``_version`` is its counter

    def versions(self, tensors: list[torch.Tensor]) -> list:
        """Every tensor's version counter now, which the copy compares (``hooks.check_unchanged``)."""
        if self.plain:
            return [t._version for t in tensors]
        return [version_of(t) for t in tensors]


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

    def flatten(self, state: dict) -> Flattened:
        return flatten_for_save(state, self._providers)

    def layout(self, flat: Flattened, optimizers: list) -> Layout:
        items, key, cached = flat.tensors, _optimizers_key(optimizers), self._layout
        if self._providers is not None and cached is not None and cached.optimizers == key and \
                len(cached.items) == len(items) and all(map(operator.is_, cached.items, items)):
            return cached
        metas = [item.meta(dtype_name(item.dtype)) for item in items]
        # Each item may sit up to a block further on in the arena, at its file offset's distance
        # from a block boundary (direct I/O).
        self._layout = Layout(list(items), key, metas, owners_of([item.local for item in items], optimizers),
                              sum(align_up(m.nbytes, ALIGN) + DIRECT_ALIGN for m in metas),
                              any(item.local.device.type == "cuda" for item in items),
                              not any(is_dtensor(item.local) or item.local.is_inference() for item in items))
        return self._layout

