"""The few collectives a save or load needs, and a single-process stand-in for them.

Every cross-rank step goes through :class:`Comm`, so errors travel too: a rank that failed
contributes its error instead of its result, and :meth:`Comm.agree` makes every rank raise the
same ``CheckpointError`` instead of some ranks hanging in the next collective.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..errors import CheckpointError


class RemoteFailure(CheckpointError):
    pass


class Comm:
    def __init__(self, group=None):
        self.active = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1

    def all_gather(self, obj: Any) -> list:
        if not self.active or self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> list | None:
        """Objects of all ranks on rank 0, None elsewhere."""
        if not self.active or self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self._global(0), group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        if not self.active or self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        return box[0]

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank if any rank failed ``what``; return normally if all succeeded."""
        errors = self.all_gather(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"{what} failed on rank {self.rank}: {error}") from error
        failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None)
        if failed:
            raise RemoteFailure(f"{what} failed on another rank: {failed}")

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)
