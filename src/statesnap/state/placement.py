"""Where a DTensor's local shard sits in its global tensor, computed from its placements.

DTensor sharding follows ``torch.chunk``: a dimension of n split k ways gives chunks of
ceil(n / k), with the last ones short or empty. Shards on several mesh dimensions nest,
left to right over the mesh.

``_StridedShard(dim, split_factor)`` is what FSDP2 produces over a tensor-parallel parameter
(FSDP x TP meshes): FSDP chunks the *TP-local* tensor, i.e. the shards nest right to left. In
recent PyTorch it is not a ``Shard`` subclass, so it is recognised by its ``split_factor``. It
is one box exactly when its split factor equals the number of shards that later mesh
dimensions cut the same tensor dimension into (FSDP2's case): then the plain shards are applied
first and the strided ones after them, innermost last. Any other strided layout interleaves rows
from several places and is refused rather than mislabelled. ``tests/test_reshard.py`` checks
this against ``DTensor.full_tensor()`` on a real 2-D mesh.
"""
from __future__ import annotations

from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import CheckpointError


def chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of chunk ``index`` when ``torch.chunk`` splits ``length`` into ``parts``."""
    step = -(-length // parts) if length else 0
    start = min(index * step, length)
    return start, min(step, length - start)


def _is_strided(placement) -> bool:
    return hasattr(placement, "split_factor") and isinstance(getattr(placement, "dim", None), int)


def _shard_order(dt: DTensor, fqn: str) -> list[int]:
    """Mesh dimensions in the order their shards nest: plain shards, then strided ones reversed."""
    plain, strided = [], []
    for mesh_dim, placement in enumerate(dt.placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, Shard):
            plain.append(mesh_dim)
        elif _is_strided(placement):
            later = 1
            for other in range(mesh_dim + 1, len(dt.placements)):
                if isinstance(dt.placements[other], Shard) and dt.placements[other].dim == placement.dim:
                    later *= dt.device_mesh.size(other)
            if int(placement.split_factor) != later:
                raise CheckpointError(
                    f"{fqn}: placement {placement!r} with placements {dt.placements} is not the FSDP-over-TP "
                    "layout statesnap can describe as one box; redistribute the DTensor to Shard/Replicate")
            strided.append(mesh_dim)
        else:
            raise CheckpointError(f"{fqn}: placement {placement} (e.g. Partial) cannot be checkpointed; "
                                  "redistribute the DTensor to Shard or Replicate first")
    return plain + strided[::-1]


def dtensor_box(dt: DTensor, fqn: str) -> tuple[tuple, tuple] | None:
    """(start, size) of this rank's shard of ``dt``; None if the rank is off the mesh."""
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    start = [0] * dt.ndim
    size = list(dt.shape)
    for mesh_dim in _shard_order(dt, fqn):
        dim = dt.placements[mesh_dim].dim
        offset, length = chunk_bounds(size[dim], mesh.size(mesh_dim), coord[mesh_dim])
        start[dim] += offset
        size[dim] = length
    local = dt.to_local()
    if tuple(local.shape) != tuple(size):
        raise CheckpointError(f"{fqn}: local shard shape {tuple(local.shape)} does not match the shard "
                              f"{tuple(size)} computed from placements {dt.placements}")
    return tuple(start), tuple(size)


def has_replicate(dt: DTensor) -> bool:
    """Whether some mesh dimension replicates ``dt``: the layout itself declares those copies
    replicas, so saves do not compare them."""
    return any(isinstance(p, Replicate) for p in dt.placements)


def is_dtensor(value) -> bool:
    return isinstance(value, DTensor)
