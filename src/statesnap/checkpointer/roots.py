"""The claims of one :class:`~statesnap.checkpointer.Checkpointer` on its storage roots.

A job writes, deletes and clears leftovers only in roots it holds: rank 0 claims the shared
roots (persistent, further), each node's leader its node-local one. Another live job on the same
root would otherwise delete this job's saves in flight (its cleanup), its checkpoints (its
retention), or restore its steps into the wrong model (``storage/lock.py`` holds the claims).
"""
from __future__ import annotations

import logging
import warnings

from ..engine.dist import Comm
from ..errors import CheckpointError, described, explained
from .config import CheckpointerConfig
from .levels import StorageLevel

log = logging.getLogger("statesnap")


class RootClaims:
    """Claims ``shared`` (persistent, then further) from rank 0 and ``local`` from each node's
    leader, for the ranks of ``comm``."""

    def __init__(self, shared: list[StorageLevel], local: StorageLevel | None, comm: Comm,
                 config: CheckpointerConfig):
        self.shared, self.local, self._comm, self._config = shared, local, comm, config

    def claim_shared(self) -> None:
        """Rank 0 claims the shared roots for this job and clears what crashed saves left there;
        every rank raises if it could not (another live job owns a root). Storage that cannot be
        reached is raised too, unless a node-local level can hold the steps meanwhile: then the
        job starts (or restarts from the local level) without that level, and claims it again
        at each step due there (see docs/checkpointer.md, "Failure matrix")."""
        problem, unreachable = None, {}
        if self._comm.rank == 0:
            # Whatever fails here must reach the broadcast: the other ranks wait in it.
            for level in self.shared:
                try:
                    outage = self.try_claim(level)
                except CheckpointError as exc:
                    problem = exc
                    break
                if outage is not None and self.local is None:
                    problem = outage
                    break
                if outage is not None:
                    unreachable[level.name] = str(outage)
            if problem is not None:
                self._release_quietly()
        try:
            problem, unreachable = self._comm.broadcast((problem, unreachable))
        except BaseException:  # a rank lost before it got the outcome (PeerLostError): no claim stays
            self._release_quietly()
            raise
        if problem is not None:
            raise problem
        for level in self.shared:
            level.unreachable = unreachable.get(level.name)
            if level.unreachable is not None and self._comm.rank == 0:
                message = (f"statesnap: starting without the {level.name} level ({level.unreachable}); steps due "
                           "there stay in memory and the node-local level until it can be claimed again")
                log.warning(message)
                warnings.warn(message, RuntimeWarning, stacklevel=3)

    def try_claim(self, level: StorageLevel) -> CheckpointError | None:
        """Rank 0: claim ``level``'s root and clear what crashed saves left there. Another job
        holding it is raised; storage that cannot be reached or written is returned."""
        try:
            level.claim_root(self._config.take_over, self._config.lease_s)
            level.remove_leftovers()
            return None
        except CheckpointError:
            raise
        except OSError as exc:  # a root that is a file, a directory we may not write, a lost mount
            outage = CheckpointError(f"cannot keep checkpoints under {level.root}: {explained(exc)}")
        except Exception as exc:  # noqa: BLE001 - a storage library's own error (connection refused, ...)
            outage = CheckpointError(f"cannot claim {level.root} for this job: {described(exc)}")
            outage.__cause__ = exc
        try:
            level.release()
        except Exception:  # noqa: BLE001 (the storage is gone; its lease runs out by itself)
            level.claim = None
        return outage

    def reachable(self, level: StorageLevel, step: int) -> bool:
        """Whether ``step`` can go to ``level``: yes unless it was unreachable, in which case rank
        0 tries to claim it again now (collective: every rank saves the same steps)."""
        if level.unreachable is None:
            return True
        outage = None
        if self._comm.rank == 0:
            try:
                outage = self.try_claim(level)
            except CheckpointError as exc:  # taken by another job meanwhile: never ours again
                outage = exc
        outage = self._comm.broadcast(None if outage is None else str(outage))
        if outage is None:
            level.unreachable = None
            log.warning("statesnap: the %s level at %s is back; step %d goes there", level.name, level.root, step)
            return True
        level.unreachable = outage
        log.warning("statesnap: step %d stays in memory and the node-local level: the %s level is unreachable (%s)",
                    step, level.name, outage)
        return False

    def claim_local(self, leader: bool, node_comm: Comm) -> None:
        """The node's leader claims the node-local level, then clears what crashed saves left
        there. Only once the shared roots are this job's: a job refused them must not delete the
        holder's saves in flight. Every rank of the node waits for it (one listing the level
        meanwhile would see it half cleared), and a failure is raised on each, with every root
        released."""
        error = None
        if leader:
            try:
                self.local.claim_root(self._config.take_over, self._config.lease_s)
                self.local.remove_leftovers()
            except Exception as exc:  # noqa: BLE001 (raised below, on every rank of the node)
                error = exc
        try:
            node_comm.agree(error, f"claiming the node-local level {self.local.root}")
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for level in (*self.shared, self.local):
            if level is not None:
                level.release()

    def _release_quietly(self) -> None:
        """After a failed start, which raises its own error, not this one's."""
        try:
            self.release()
        except Exception:  # noqa: BLE001
            log.warning("statesnap: releasing the claimed roots after a failed start failed", exc_info=True)
