"""What providers produce: items that say which part of which logical tensor a rank holds."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from ..errors import CheckpointError
from ..format.dtypes import DTYPE_TO_NAME
from ..format.manifest import BOX, FLAT

SEP = "."  # between the keys of nested dicts in a fully qualified name


def join(prefix: str, key: Any) -> str:
    try:
        return f"{prefix}{SEP}{key}" if prefix else str(key)
    except ValueError:
        if not isinstance(key, int):
            raise
        # an int of more digits than Python spells (4,300 by default)
        raise CheckpointError(f"{prefix or 'the state'}: a key of {key.bit_length()} bits is too long to name "
                              "what it holds; use shorter keys (or store the dict as plain data)") from None


class ItemMeta(NamedTuple):
    """The rank-independent description of a tensor item, exchanged between ranks for planning."""

    fqn: str
    dtype: str
    shape: tuple
    layout: str
    start: tuple
    size: tuple
    nbytes: int


@dataclass
class TensorItem:
    """A rank's local tensor and its place in the logical tensor ``fqn``.

    ``layout == "box"``: ``local`` is the block at offsets ``start`` with extents ``size``.
    ``layout == "flat"``: ``local`` flattened is the range ``start[0] : start[0] + size[0]`` of
    the row-major flattened logical tensor. ``replicated``: the state declares that ranks
    holding the same part may hold different values and one copy is enough (``ss.Replicated``,
    DTensor ``Replicate``, DDP buffers), so the save does not compare its replicas.
    """

    fqn: str
    local: torch.Tensor
    global_shape: tuple | None = None  # None: the local tensor's own shape (read once it is known to have one)
    layout: str = BOX
    start: tuple = ()
    size: tuple = ()
    replicated: bool = False
    # the DTensor ``local`` is this rank's part of: a rank whose part is empty tells by it that two
    # names hold one tensor (a tied weight), which ranks holding elements tell by their memory
    origin: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        problem = _unstorable(self.local)
        if problem:
            raise CheckpointError(f"tensor {self.fqn!r} {problem}")
        # (a torch.Size holds Python ints; a given shape may hold numpy or symbolic ones)
        self.global_shape = tuple(self.local.shape) if self.global_shape is None else tuple(map(int, self.global_shape))
        if not self.size and self.layout == BOX:
            self.start, self.size = (0,) * len(self.global_shape), self.global_shape

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def nbytes(self) -> int:
        return self.local.numel() * self.local.element_size()

    def meta(self, dtype_name: str) -> ItemMeta:
        return ItemMeta(self.fqn, dtype_name, self.global_shape, self.layout,
                        tuple(self.start), tuple(self.size), self.nbytes)


def _unstorable(t: torch.Tensor) -> str | None:
    """Why ``t``'s values cannot be read or written as plain bytes, or None. (A nested tensor of
    the strided layout has no shape to ask for: it is looked for first.)"""
    if type(t).__name__ == "ShardedTensor":  # (torch.distributed._shard's, which refuses to be asked anything)
        return ("is a ShardedTensor, which FSDP1 gives without a device mesh; build FSDP with "
                "device_mesh=init_device_mesh(...) (its state dict then holds DTensors, stored piece by piece), "
                "or shard with fully_shard (FSDP2)")
    try:
        nested = t.is_nested
    except Exception as exc:  # noqa: BLE001 (a tensor subclass whose __torch_function__ refuses it)
        return f"is a {type(t).__name__} that cannot be read as a tensor ({type(exc).__name__}: {str(exc)[:200]})"
    if nested:
        return ("is a nested tensor: only dense (strided) tensors are saved or loaded into (t.unbind() gives its "
                "components, t.to_padded_tensor(0.0) one dense tensor)")
    if t.layout != torch.strided:
        return f"is {str(t.layout)[6:]}: only dense (strided) tensors are saved or loaded into (t.to_dense() gives one)"
    if t.dtype not in DTYPE_TO_NAME:
        hint = (": store its integers (t.int_repr()) and its quantization parameters (t.q_scale() and "
                "t.q_zero_point(), or the per-channel ones), or t.dequantize()") if t.is_quantized else ""
        return f"has dtype {t.dtype}, which the statesnap format does not store{hint}"
    if t.is_meta:
        return "is on the meta device: it has no values (materialise it, e.g. with to_empty, first)"
    if t.numel() and not t.data_ptr():
        return f"is a {type(t).__name__} without memory of its own: store the tensors it wraps"
    return None


def refuse_unwritable(item: TensorItem) -> None:
    """Refuse, naming it, a load target whose elements share memory: an expanded view (stride 0,
    ``t.expand``) holds one value in memory for many, and so may a view with strides too small
    for its sizes (``t.unfold`` windows that overlap, ``as_strided``). No checkpoint fills it
    unless all those copies are stored alike: the last write would win, without a word (PyTorch
    refuses only the stride-0 case, in words that name no tensor)."""
    t = item.local
    if t.is_contiguous():  # (the commonest, and cheapest to ask)
        return
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if size > 1 and stride == 0:
            raise CheckpointError(
                f"tensor {item.fqn!r} is an expanded view (stride 0 in dimension {dim}, t.expand): its "
                f"{size} elements along it share one place in memory, so a load cannot give each its own "
                "value. Load into a tensor of its own (t.clone()), or into what it was expanded from")
    if _strides_apart(t):
        return
    where = f"(shape {tuple(t.shape)}, strides {t.stride()}, as unfold or as_strided can make)"
    if t.numel() > _LARGEST_CHECKED:
        raise CheckpointError(
            f"tensor {item.fqn!r} is a view whose strides {where} may put two elements at one place in "
            f"memory, and it is too large (over {_LARGEST_CHECKED:,} elements) to check. Load into a tensor "
            "of its own (t.clone()) and copy from it")
    if _addresses_repeat(t):
        raise CheckpointError(
            f"tensor {item.fqn!r} is a view whose elements overlap in memory {where}: two of them are one "
            "place, so a load cannot give each its own value. Load into a tensor of its own (t.clone()) "
            "and copy from it")


_LARGEST_CHECKED = 1 << 24  # elements whose addresses are listed to check an unusual layout (128 MiB, twice in the sort)


def _strides_apart(t: torch.Tensor) -> bool:
    """Whether each stride, taken in increasing order, passes the furthest the smaller ones reach:
    then every element has its own address. True of transposes, slices and permutes of a
    tensor of its own; only views such as ``unfold``'s or ``as_strided``'s need the list."""
    reach = 0
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True


def _addresses_repeat(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` have one address, counted over the list of them all."""
    addresses = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        addresses = addresses.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return torch.unique(addresses).numel() != t.numel()


@dataclass
class ObjectItem:
    """A non-tensor value; ``assign`` puts a loaded value back where the template had it."""

    fqn: str
    value: Any
    assign: Callable[[Any], None] | None = None
    # raises where ``assign`` could not take the value (an element of a tuple that differs): a
    # load asks before it writes anything, so that such a state is refused as it was
    check: Callable[[Any], None] | None = None
    per_rank: Any = None  # the PerRank wrapper, for per-rank values
    replicated: bool = False  # declared (ss.Replicated): ranks may differ, rank 0's value is kept
    # in the state dict of a module, optimizer or stateful object, whose load_state_dict puts it
    # back (its own way), not in one of the state's own containers, filled in place
    owned: bool = False


@dataclass
class Flattened:
    tensors: list[TensorItem]
    objects: list[ObjectItem]
    # Run after a load has filled tensors and objects: load_state_dict calls and the like.
    finalizers: list[Callable[[], None]]


__all__ = ["ItemMeta", "TensorItem", "ObjectItem", "Flattened", "BOX", "FLAT"]
