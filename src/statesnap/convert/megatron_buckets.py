"""megatron-core's ``dp_reshardable`` distributed-optimizer state cut back into per-parameter tensors.

With ``distrib_optim_sharding_type="dp_reshardable"`` the fp32 master weights and Adam moments are
saved as the optimizer holds them: one flat tensor per gradient bucket
(``optimizer.distributed.dp_group_idx_G.gbuf_idx_B.dtype_(...).bucket_idx_K.param|exp_avg|exp_avg_sq``),
in which megatron-core's ``_ParamAndGradBuffer`` (distributed/param_and_grad_buffer.py) placed the
parameters:

- in *reverse* ``named_parameters()`` order (roughly the order backward produces gradients);
- each parameter starting at a multiple of 64 elements (the distributed optimizer's alignment);
- a bucket closing after the parameter that reaches its size, or before a shared (tied) embedding,
  which gets a bucket of its own; the next bucket starts after the previous one's padded size.

The checkpoint records each bucket's padded and unpadded size (``per_bucket_numel``,
``per_bucket_numel_unpadded``) and each tensor is saved at its unpadded size, but not which
parameter sits where. That is recovered from the model section of the same checkpoint: its key
order is the model's state-dict order (the ``named_parameters()`` order), its shapes give each
parameter's size. The walk above must then end every bucket exactly at its recorded unpadded size;
anything else (an optimizer saved without its model, a model whose parameters do not all train,
several data-parallel groups under TP/PP, several dtypes) is a :class:`CheckpointError` rather than
a guess. What the sizes cannot catch is two adjacent parameters of equal size listed in the
wrong order; megatron-core's state-dict order makes that impossible for checkpoints it wrote.
"""
from __future__ import annotations

import math
import re
from functools import partial
from typing import Any

import torch

from ..errors import CheckpointError
from .transform import Lazy, materialize

ALIGN = 64  # _pad_start_of_param_if_needed
KEYS = {"param": "fp32.{}", "exp_avg": "optim.state.{}.exp_avg", "exp_avg_sq": "optim.state.{}.exp_avg_sq"}
_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(?P<group>\d+)\.gbuf_idx_(?P<gbuf>\d+)\.dtype_(?P<dtype>.*)"
                     r"\.bucket_idx_(?P<bucket>\d+)\.(?P<key>\w+)")


def sharded_object(distributed: dict, folder: str, what: str) -> Any:
    """The one value of the ShardedObject ``optimizer.distributed.dp_group_idx_G.<what>`` (DCP hands
    dist_checkpointing's byte entries back as one-element lists)."""
    names = [n for n in distributed if re.fullmatch(rf"optimizer\.distributed\.dp_group_idx_\d+\.{what}/shard_.*", n)]
    if len(names) != 1:
        raise CheckpointError(f"{folder}: expected one optimizer.distributed.*.{what} entry, found {names or 'none'}; "
                              "dp_reshardable optimizer state is imported for one data-parallel group (TP=PP=1) only; "
                              "save with distrib_optim_sharding_type='fully_reshardable' under model parallelism")
    value = distributed[names[0]]
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def bucket_values(distributed: dict[str, Any], order: list[tuple[str, tuple]], folder: str) -> dict[str, Any]:
    """``{fp32.<param>, optim.state.<param>.exp_avg|exp_avg_sq: Lazy}`` cut out of the bucket tensors
    in ``distributed``; ``order`` is ``(model.<param>, shape)`` in ``named_parameters()`` order."""
    padded = _sizes(sharded_object(distributed, folder, "per_bucket_numel"), folder)
    unpadded = _sizes(sharded_object(distributed, folder, "per_bucket_numel_unpadded"), folder)
    buckets: dict[int, dict[str, Any]] = {}
    for name, value in distributed.items():
        m = _BUCKET.fullmatch(name)
        if m:
            if m.group("key") not in KEYS:
                raise CheckpointError(f"{folder}: {name}: optimizer state {m.group('key')!r} is not Adam's "
                                      f"({', '.join(KEYS)})")
            buckets.setdefault(int(m.group("bucket")), {})[m.group("key")] = value
    if sorted(buckets) != list(range(len(unpadded))) or len(padded) != len(unpadded):
        raise CheckpointError(f"{folder}: buckets {sorted(buckets)} saved, but per_bucket_numel lists {len(unpadded)}")
    out: dict[str, Any] = {}
    for name, shape, bucket, start in layout(order, padded, unpadded, folder):
        param = name[len("model."):]
        for key, tensor in buckets[bucket].items():
            if tuple(tensor.shape) != (unpadded[bucket],):
                raise CheckpointError(f"{folder}: bucket {bucket} {key} has shape {list(tensor.shape)}, expected "
                                      f"[{unpadded[bucket]}] (per_bucket_numel_unpadded)")
            out[KEYS[key].format(param)] = Lazy(tensor.dtype, shape, partial(_cut, tensor, start, shape))
    return out


def _cut(bucket: Any, start: int, shape: tuple) -> torch.Tensor:
    """One parameter's elements of a bucket, in storage of its own (not a view keeping the bucket)."""
    return materialize(bucket).narrow(0, start, math.prod(shape)).reshape(shape).clone()


def _sizes(per_gbuf: Any, folder: str) -> list[int]:
    """The bucket sizes of the one gradient buffer: ``[{(param dtype, grad dtype): [sizes]}]``."""
    if not (isinstance(per_gbuf, list) and len(per_gbuf) == 1 and isinstance(per_gbuf[0], dict)
            and len(per_gbuf[0]) == 1):
        raise CheckpointError(f"{folder}: per_bucket_numel {per_gbuf!r} is not one buffer of one dtype; "
                              "mixed-dtype or multi-buffer dp_reshardable state is not supported")
    sizes = next(iter(per_gbuf[0].values()))
    if not isinstance(sizes, list) or not all(type(n) is int and n > 0 for n in sizes):
        raise CheckpointError(f"{folder}: per_bucket_numel {per_gbuf!r} does not list bucket sizes")
    return sizes


def layout(order: list[tuple[str, tuple]], padded: list[int], unpadded: list[int],
           folder: str) -> list[tuple[str, tuple, int, int]]:
    """``(name, shape, bucket, offset in the bucket)`` of every parameter, placed as
    ``_ParamAndGradBuffer`` places them (see the module docstring), checked against the sizes."""
    placed, bucket, bucket_start, position = [], 0, 0, 0
    for name, shape in reversed(order):
        start = -(-position // ALIGN) * ALIGN
        if bucket < len(unpadded) and start > bucket_start and start - bucket_start == unpadded[bucket]:
            bucket_start, bucket = bucket_start + padded[bucket], bucket + 1  # a tied embedding's own bucket
            start = bucket_start
        if bucket == len(unpadded):
            raise CheckpointError(f"{folder}: the optimizer buckets ({unpadded} elements) end before parameter "
                                  f"{name}; the model section does not match the optimizer's parameters")
        end = start + math.prod(shape)
        if end - bucket_start > unpadded[bucket]:
            raise CheckpointError(f"{folder}: parameter {name} {list(shape)} would end at {end - bucket_start} in "
                                  f"bucket {bucket} of {unpadded[bucket]} elements; the model section does not match "
                                  "the optimizer's parameters")
        placed.append((name, shape, bucket, start - bucket_start))
        if end - bucket_start == unpadded[bucket]:
            bucket_start, bucket = bucket_start + padded[bucket], bucket + 1
            end = bucket_start
        position = end
    if bucket != len(unpadded):
        raise CheckpointError(f"{folder}: the model's parameters fill {bucket} of the {len(unpadded)} optimizer "
                              f"buckets ({unpadded} elements); the model section does not match the optimizer's "
                              "parameters")
    return placed
