"""State providers: flatten a training state into items with their place in global tensors."""
from .flatten import flatten_for_load, flatten_for_save
from .items import Flattened, ItemMeta, ObjectItem, TensorItem
from .wrappers import PerRank, Replicated, Sharded, flat_partition

__all__ = ["flatten_for_save", "flatten_for_load", "Flattened", "ItemMeta", "ObjectItem", "TensorItem",
           "PerRank", "Replicated", "Sharded", "flat_partition"]
