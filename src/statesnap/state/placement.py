"""Where a DTensor's local shard sits in its global tensor, computed from its placements.

DTensor sharding follows ``torch.chunk``: a dimension of n split k ways gives chunks of
ceil(n / k), with the last ones short or empty. Shards on several mesh dimensions nest. A
``_StridedShard`` (what FSDP2 produces over a tensor-parallel parameter) is applied *after* the
plain shards of the same tensor dimension, because FSDP2 chunks the TP-local tensor; treating it
left-to-right, as its chunk list does in some torch versions, mislabels the rows.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import CheckpointError


def chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of chunk ``index`` when ``torch.chunk`` splits ``length`` into ``parts``."""
    step = -(-length // parts) if length else 0
    start = min(index * step, length)
    return start, min(step, length - start)


def dtensor_box(dt: DTensor, fqn: str) -> tuple[tuple, tuple] | None:
    """(start, size) of this rank's shard of ``dt``; None if the rank is off the mesh."""
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    start = [0] * dt.ndim
    size = list(dt.shape)
    plain, strided = [], []
    for mesh_dim, placement in enumerate(dt.placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, Shard):
            (strided if type(placement).__name__ == "_StridedShard" else plain).append(mesh_dim)
        else:
            raise CheckpointError(f"{fqn}: placement {placement} (e.g. Partial) cannot be checkpointed; "
                                  "redistribute the DTensor to Shard or Replicate first")
    for mesh_dim in plain + strided[::-1]:
        dim = dt.placements[mesh_dim].dim
        offset, length = chunk_bounds(size[dim], mesh.size(mesh_dim), coord[mesh_dim])
        start[dim] += offset
        size[dim] = length
    local = dt.to_local()
    if tuple(local.shape) != tuple(size):
        raise CheckpointError(f"{fqn}: local shard shape {tuple(local.shape)} does not match the shard "
                              f"{tuple(size)} computed from placements {dt.placements}")
    return tuple(start), tuple(size)


def is_dtensor(value) -> bool:
    return isinstance(value, DTensor)


def local_of(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value
