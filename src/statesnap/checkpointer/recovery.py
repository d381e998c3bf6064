"""Restoring from the node-local level and the peer replicas.

A step is complete on these levels when the nodes together hold every data file its manifest
names (a node lost, or wiped, holds nothing). To load it, each node first gets the files its
ranks' load reads and it lacks, from a node that has them, over the dedicated group: the node
leader writes them into its own ``step-N`` (creating and committing it if the node had lost it).
Then every rank loads from its own node's ``step-N`` with ``ss.load``, which verifies every
piece against its checksum: a damaged copy fails the load on every rank, and the caller falls
back to the next level. The load is labelled ``"local"`` when no file moved, ``"peer"`` when one
did.
"""
from __future__ import annotations

import uuid

import torch

from ..engine.dist import Comm
from ..engine.load import prefix_lookup, load
from ..errors import CheckpointError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..plan import plan_target
from ..state.flatten import flatten_for_load
from .levels import StorageLevel
from .local import PEER_CHUNK_BYTES, Topology, pwriter, recv_stream, send_stream


def inventory(level: StorageLevel) -> dict[int, tuple[list[str], list[str]]]:
    """step -> (data files this node holds, data files the manifest names), committed steps only."""
    out = {}
    for step in level.committed_steps():
        path = level.path(step)
        try:
            manifest = Manifest.from_bytes(level.backend.read_bytes(level.backend.join(path, MANIFEST_NAME)),
                                           where=path)
        except Exception:  # noqa: BLE001 (a damaged manifest: this node does not count as holding it)
            continue
        held = set(level.backend.listdir(path))
        out[step] = (sorted(f for f in manifest.files if f in held), list(manifest.files))
    return out


def complete_steps(inventories: list[dict]) -> list[int]:
    """Steps whose files the nodes hold together (every rank's inventory is its node's), newest first."""
    steps = set().union(*(inv.keys() for inv in inventories))
    complete = []
    for step in steps:
        held = set().union(*(set(inv[step][0]) for inv in inventories if step in inv))
        named = next(inv[step][1] for inv in inventories if step in inv)
        if held >= set(named):
            complete.append(step)
    return sorted(complete, reverse=True)


def files_needed(manifest: Manifest, state: dict) -> set[str]:
    """The data files this rank's load of ``manifest`` into ``state`` reads (all, if the state
    does not match: the load then reports the mismatch itself)."""
    try:
        flat = flatten_for_load(state, prefix_lookup(manifest))
        needed = set()
        for item in flat.tensors:
            entry = manifest.tensors[item.fqn]
            plan = plan_target(entry, item.layout, item.start, item.size)
            needed.update(manifest.files[int(entry.file[read.piece])] for read in plan.reads)
        for item in flat.objects:
            entry = manifest.objects[item.fqn]
            for part in (entry.per_rank or [entry]):
                if part.kind == "pickle":
                    needed.add(manifest.files[part.value[0]])
        return needed
    except Exception:  # noqa: BLE001
        return set(manifest.files)


class LocalRecovery:
    """Loads a step from the node-local level, fetching what a node lacks from the others."""

    def __init__(self, level: StorageLevel, comm: Comm, topology: Topology, durable: bool):
        self.level, self.comm, self.topology, self.durable = level, comm, topology, durable

    def restore(self, state: dict, step: int, inventories: list[dict], **load_options) -> tuple[int, bool]:
        """Load ``step`` into ``state``; return (bytes read, whether files came from other nodes)."""
        comm, topo, backend = self.comm, self.topology, self.level.backend
        holders = [r for r, inv in enumerate(inventories) if step in inv]
        mine = inventories[comm.rank].get(step, ([], []))[0]
        raw = backend.read_bytes(backend.join(self.level.path(step), MANIFEST_NAME)) \
            if comm.rank == holders[0] else None
        raw = comm.all_gather(raw)[holders[0]]
        manifest = Manifest.from_bytes(raw, where=f"{self.level.path(step)} (node of rank {holders[0]})")
        lacking = sorted(files_needed(manifest, state) - set(mine))
        wants = comm.all_gather(lacking)
        transfers = sorted({(name, self._holder(name, step, inventories), topo.leader(r))
                            for r, names in enumerate(wants) for name in names})
        error = None
        try:
            self._fetch(step, raw, transfers, inventories)
        except Exception as exc:  # noqa: BLE001 (every rank raises together below)
            error = exc
        comm.agree(error, f"fetching the files of step {step} from other nodes")
        info = load(state, self.level.path(step), shared_reads=False, **load_options)
        return info.bytes, bool(transfers)

    def _holder(self, name: str, step: int, inventories: list[dict]) -> int:
        for rank, inv in enumerate(inventories):
            if step in inv and name in inv[step][0]:
                return rank
        raise CheckpointError(f"no node holds {name} of step {step}")  # complete_steps rules this out

    def _fetch(self, step: int, raw: bytes, transfers: list, inventories: list[dict]) -> None:
        """Run the transfers in one global order (see ``LocalFlusher._exchange``); a node leader
        that lacks the step creates it, with the manifest, and commits it once its files are in."""
        comm, backend, rank = self.comm, self.level.backend, self.comm.rank
        final, staging = self.level.path(step), None
        receiving = any(dst == rank for _, _, dst in transfers)
        if receiving and step not in inventories[rank]:
            staging = backend.begin(final, uuid.uuid4().hex[:12])
            backend.write_bytes(backend.join(staging, MANIFEST_NAME), raw, self.durable)
        target = staging or final
        group = comm.transport() if comm.world_size > 1 else None
        buffer = torch.empty(PEER_CHUNK_BYTES if receiving else 0, dtype=torch.uint8)
        try:
            for name, src, dst in transfers:
                if src == dst == rank:
                    continue
                if rank == src:
                    self._send(group, dst, backend.join(final, name))
                elif rank == dst:
                    writer = backend.open_write(backend.join(target, name), self.durable)
                    try:
                        if not recv_stream(group, src, buffer, pwriter(writer)):
                            raise CheckpointError(f"rank {src} could not send {name} of step {step}")
                    finally:
                        writer.close(self.durable)
            if staging is not None:
                backend.commit(staging, final, False, self.durable, keep=backend.listdir(staging))
        except BaseException:
            if staging is not None:
                backend.abort(staging, final)
            raise

    def _send(self, group, dst: int, path: str) -> None:
        backend = self.level.backend
        try:
            reader = backend.open_read(path)
        except OSError:
            send_stream(group, dst, None, None)
            raise
        buffer = torch.empty(PEER_CHUNK_BYTES, dtype=torch.uint8)

        def read(offset: int, nbytes: int) -> torch.Tensor:
            got = reader.readinto(offset, [memoryview(buffer[:nbytes].numpy())])
            if got != nbytes:
                raise CheckpointError(f"{path} ended at byte {offset + got}, before its {offset + nbytes}")
            return buffer[:nbytes]
        try:
            size = reader.size()
            send_stream(group, dst, [(0, size)] if size else [], read)
        finally:
            reader.close()

    def prune_after(self, step: int | None) -> None:
        """Node leaders drop node-local steps newer than the one restored: a run restarted from an
        older step must not find the abandoned run's later steps at its next restart."""
        if self.topology.is_leader:
            for newer in [s for s in self.level.committed_steps() if step is None or s > step]:
                self.level.backend.retire(self.level.path(newer), MANIFEST_NAME)
