"""Restoring from the node-local level and the peer replicas.

A step is complete on these levels when the nodes together hold every data file its manifest
names (a node lost, or wiped, holds nothing). To load it, each node first gets the files its
ranks' load reads and it lacks, from a node that has them, over the dedicated group: the node
leader writes them into its own ``step-N`` (creating and committing it if the node had lost it).
Every rank loads from its own node's ``step-N`` (``engine.load.Loading``): the target is matched
against the manifest before the transfers, and the state fills while they run, reading the files
the rank receives as their bytes arrive (``arrivals.py``); a rank that needs a file another rank
of its node receives fills once the node has it. Every piece is verified against its checksum: a
damaged copy fails the load on every rank, and the caller falls back to the next level. The load
is labelled ``"local"`` when no file moved, ``"peer"`` when one did.
"""
from __future__ import annotations

import logging
import uuid
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

from ..engine.dist import Comm
from ..engine.load import Loading
from ..errors import CheckpointError, described
from ..format.manifest import MANIFEST_NAME, Manifest
from ..plan import plan_target
from ..state.flatten import StoredNames, flatten_for_load
from ..state.optim_state import restore_emptied
from . import local as streams  # the stream constants, read where they live: one value for both ends
from .arrivals import Arrivals
from .levels import StorageLevel
from .local import Topology, pwriter, recv_stream, send_stream

log = logging.getLogger("statesnap")


def inventory(level: StorageLevel) -> tuple[dict[int, tuple[list[str], int, int]], dict[int, str]]:
    """(step -> (data files this node holds, how many files the manifest names, a digest of their
    names), committed steps only; step -> why its manifest cannot be read, for the steps this
    node does not count as holding). Every rank sends its node's inventory to every other, so it
    holds the node's own files, not the job's list: that would make each rank receive
    ranks x files names, quadratic in the size of the job."""
    out, unreadable = {}, {}
    try:
        steps = level.committed_steps()
    except Exception as exc:  # noqa: BLE001 (a failing node disk: the other nodes and levels may still serve)
        log.warning("statesnap: the node-local level at %s cannot be listed (%s); this node holds none of its "
                    "steps for this restore", level.root, described(exc))
        return out, unreadable
    for step in steps:
        path = level.path(step)
        try:
            manifest = Manifest.from_bytes(level.backend.read_bytes(level.backend.join(path, MANIFEST_NAME)),
                                           where=path)
            held = set(level.backend.listdir(path))
        except Exception as exc:  # noqa: BLE001 (a damaged manifest: this node does not count as holding it)
            unreadable[step] = described(exc)
            continue
        out[step] = (sorted(f for f in manifest.files if f in held), len(manifest.files),
                     zlib.crc32("\n".join(manifest.files).encode()))
    return out, unreadable


def unusable_steps(inventories: list[dict], unreadable: list[dict[int, str]]) -> dict[int, str]:
    """The committed node-local steps no restore can take, and why: a manifest no node can read,
    or data files the nodes do not hold whole together (a node lost without a peer replica, a
    file deleted). Each is named when a restore passes over it, as a copy that fails is."""
    whole = set(complete_steps(inventories))
    out = {step: why for node in unreadable for step, why in node.items() if step not in whole}
    for step in set().union(*(inv.keys() for inv in inventories)) - whole - set(out):
        count = max(inv[step][1] for inv in inventories if step in inv)
        held = set().union(*(inv[step][0] for inv in inventories if step in inv))
        out[step] = f"the nodes hold {len(held)} of its {count} data files"
    return out


def copy_of(inventories: list[dict], step: int) -> tuple[int, int] | None:
    """The (file count, names digest) of the copy of ``step`` that the nodes hold whole together,
    or None. Nodes holding another commit of the same step (another run's) do not count."""
    held: dict[tuple[int, int], set] = {}
    for inv in inventories:
        if step in inv:
            files, count, digest = inv[step]
            held.setdefault((count, digest), set()).update(files)
    whole = [key for key, files in held.items() if len(files) == key[0]]
    return max(whole, key=lambda key: len(held[key])) if whole else None


def complete_steps(inventories: list[dict]) -> list[int]:
    """Steps whose files the nodes hold together (every rank's inventory is its node's), newest first."""
    steps = set().union(*(inv.keys() for inv in inventories))
    return sorted((step for step in steps if copy_of(inventories, step) is not None), reverse=True)


def files_needed(manifest: Manifest, state: dict) -> set[str]:
    """The data files this rank's load of ``manifest`` into ``state`` reads (all, if the state
    does not match: the load then reports the mismatch itself). The state is left as it was: a
    fresh optimizer's state, which flattening makes, is taken away again (the load makes its
    own, and clears it if the load fails; one made here would outlive a failed load, zeroed)."""
    fresh: list[tuple] = []
    try:
        flat = flatten_for_load(state, StoredNames.of_manifest(manifest), fresh=fresh)
        needed = set()
        for item in flat.tensors:
            entry = manifest.tensors.get(item.fqn)
            if entry is None:  # (a tied weight stored under its other name only: that one is read)
                continue
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
    finally:
        restore_emptied(fresh)


class LocalRecovery:
    """Loads a step from the node-local level, fetching what a node lacks from the others."""

    def __init__(self, level: StorageLevel, comm: Comm, topology: Topology, durable: bool):
        self.level, self.comm, self.topology, self.durable = level, comm, topology, durable

    def restore(self, state: dict, step: int, inventories: list[dict], **load_options) -> tuple[int, bool]:
        """Load ``step`` into ``state``; return (bytes read, whether files came from other nodes)."""
        comm, backend = self.comm, self.level.backend
        chosen = copy_of(inventories, step)  # nodes holding another run's commit of the step hold nothing here
        inventories = [{step: inv[step]} if step in inv and tuple(inv[step][1:]) == chosen else {}
                       for inv in inventories]
        holders = [r for r, inv in enumerate(inventories) if step in inv]
        mine = inventories[comm.rank].get(step, ([],))[0]
        raw = backend.read_bytes(backend.join(self.level.path(step), MANIFEST_NAME)) \
            if comm.rank == holders[0] else None
        raw = comm.broadcast(raw, src=holders[0])
        manifest = Manifest.from_bytes(raw, where=f"{self.level.path(step)} (node of rank {holders[0]})")
        lacking = sorted(files_needed(manifest, state) - set(mine))
        # The leader of a node without the step creates it now, and every rank learns where in
        # the exchange of what each lacks: one collective round less before the transfers.
        lost = self.topology.is_leader and step not in inventories[comm.rank]
        opened = self._open_staging(step, raw) if lost else (None, None)
        loading = None
        try:
            gathered = comm.all_gather((lacking, opened))
            transfers = self._plan_transfers(step, [wants for wants, _ in gathered], inventories)
            arrivals = Arrivals([name for name, _, dst in transfers if dst == comm.rank])
            loading = Loading(state, self.level.path(step), manifest=manifest, shared_reads=False, step=step,
                              **load_options)
            # The state fills while the transfers run, reading the files this rank receives as
            # their bytes arrive; a rank that needs a file another rank of its node receives fills after.
            early = set(lacking) <= set(arrivals.names)
            fill = (lambda: loading.fill(arrivals.backend(backend, self.level.path(step)))) if early else None
            self._fetch(step, gathered[self.topology.leader(comm.rank)][1], transfers, arrivals, meanwhile=fill)
        except BaseException:
            if loading is not None:  # the load made a fresh optimizer's state: the restore failed, it goes again
                loading.abandon()
            if opened[0] is not None:
                backend.abort(opened[0], self.level.path(step))  # never touches the step once it is committed
            raise
        if not early:
            loading.fill()
        return loading.finish().bytes, bool(transfers)

    def _plan_transfers(self, step: int, wants: list[list[str]], inventories: list[dict]) -> list[tuple]:
        """(file, sending rank, receiving rank) for every file a node lacks, computed alike on every
        rank: one receiver per node and file (the first of its ranks that wants it), and senders
        spread over the ranks of the nodes that hold it, so that transfers between different
        pairs of ranks run at once instead of through one rank of each node."""
        sent: Counter = Counter()
        transfers, receiving = [], set()
        for dst, names in enumerate(wants):
            for name in names:
                if (self.topology.nodes[dst], name) in receiving:
                    continue
                receiving.add((self.topology.nodes[dst], name))
                holders = [r for r, inv in enumerate(inventories) if step in inv and name in inv[step][0]]
                if not holders:
                    raise CheckpointError(f"no node holds {name} of step {step}")  # complete_steps rules it out
                src = min(holders, key=lambda r: (sent[r], r))
                sent[src] += 1
                transfers.append((name, src, dst))
        return transfers

    def _fetch(self, step: int, opened: tuple[str | None, str | None], transfers: list, arrivals: Arrivals,
               meanwhile=None) -> None:
        """Run the transfers in one global order, each rank its own (see ``LocalFlusher._exchange``
        for why that order cannot deadlock), telling ``arrivals`` how far each file received is
        written, and ``meanwhile()`` at the same time, on this thread. ``opened``: the (staging
        location, problem) of this node's leader, who created the step there if the node lacked
        it, and commits it once every rank of the job has its files in. Every rank takes part in
        every transfer of its own whatever failed, so none is left waiting; failures are raised
        on every rank together."""
        comm, topo, backend, rank = self.comm, self.topology, self.level.backend, self.comm.rank
        final = self.level.path(step)
        staging, problem = opened
        failures = [CheckpointError(problem)] if problem else []
        target = None if problem else staging or final
        group = comm.transport() if comm.world_size > 1 else None

        def transfer() -> None:
            try:
                for name, src, dst in transfers:
                    if rank == src:
                        self._send(group, dst, backend.join(final, name), failures)
                    elif rank == dst:
                        self._receive(group, src, name, step, None if target is None else backend.join(target, name),
                                      failures, arrivals)
            finally:
                arrivals.end_all("the transfers stopped")  # a fill waiting for more bytes fails, never hangs
        if meanwhile is None:
            transfer()
        else:
            with ThreadPoolExecutor(1, thread_name_prefix="statesnap-peer-send") as pool:
                sending = pool.submit(transfer)
                meanwhile()
                sending.result()
        comm.agree(failures[0] if failures else None, f"fetching the files of step {step} from other nodes")
        error = None
        if topo.is_leader and staging is not None:
            try:
                if any(topo.nodes[dst] == topo.nodes[rank] for _, _, dst in transfers):
                    # (over a copy of the step this node holds that is damaged or another run's)
                    backend.commit(staging, final, True, self.durable, keep=backend.listdir(staging))
                else:  # its ranks need none of the files: no step to make of the manifest alone
                    backend.abort(staging, final)
            except Exception as exc:  # noqa: BLE001 (every rank raises together below)
                error = exc
        comm.agree(error, f"committing the files of step {step} fetched from other nodes")

    def _open_staging(self, step: int, raw: bytes) -> tuple[str | None, str | None]:
        """Leader of a node that lost the step: (its staging location with the manifest, problem)."""
        backend, final = self.level.backend, self.level.path(step)
        try:
            staging = backend.begin(final, uuid.uuid4().hex[:12])
            backend.write_bytes(backend.join(staging, MANIFEST_NAME), raw, self.durable)
            return staging, None
        except Exception as exc:  # noqa: BLE001 (every rank learns it)
            return None, f"rank {self.comm.rank} cannot create {final}: {described(exc)}"

    def _receive(self, group, src: int, name: str, step: int, path: str | None, failures: list,
                 arrivals: Arrivals) -> None:
        """Receive ``name`` from ``src`` into ``path`` (None: receive and drop, something failed)."""
        writer, failed = None, len(failures)
        try:
            writer = self.level.backend.open_write(path, self.durable) if path is not None else None
        except Exception as exc:  # noqa: BLE001 (the stream is still received)
            failures.append(exc)
        write = arrivals.recorded(name, path, pwriter(writer)) if writer is not None else None
        try:
            if not recv_stream(group, src, streams.stream_buffer(), write):
                failures.append(CheckpointError(f"rank {src} could not send {name} of step {step}"))
        except Exception as exc:  # noqa: BLE001 (a failed write; the stream was received whole)
            failures.append(exc)
        finally:
            if writer is not None:
                writer.close(self.durable)
            problems = "; ".join(described(p) for p in failures[failed:])
            if writer is None and not problems:  # an earlier step failed: nowhere to write it
                problems = "the node could not take it"
            arrivals.ended(name, problems or None)

    def _send(self, group, dst: int, path: str, failures: list) -> None:
        backend, reader, size = self.level.backend, None, None
        try:
            reader = backend.open_read(path)
            size = reader.size()
        except OSError as exc:  # the receiver is told there is nothing
            failures.append(exc)
        buffer, sent, mappable = streams.stream_buffer(), 0, True

        def read(offset: int, nbytes: int) -> torch.Tensor:
            nonlocal sent, mappable
            if mappable:  # a local file's page cache, sent without a copy
                try:
                    mapped = reader.map(offset, nbytes)
                except (OSError, ValueError):  # no room to map it (a strict overcommit policy), or no mmap
                    mapped = None
                if mapped is not None:
                    return torch.frombuffer(mapped, dtype=torch.uint8)
                mappable = False
            # read into the buffer's slots in turn: one per chunk in flight (send_stream)
            slot = buffer[sent % streams.IN_FLIGHT * streams.PEER_CHUNK_BYTES:][:nbytes]
            sent += 1
            got = reader.readinto(offset, [memoryview(slot.numpy())])
            if got != nbytes:
                raise CheckpointError(f"{path} ended at byte {offset + got}, before its {offset + nbytes}")
            return slot
        try:
            send_stream(group, dst, None if size is None else [(0, size)] if size else [], read)
        except Exception as exc:  # noqa: BLE001 (a failed read; the stream was sent whole)
            failures.append(exc)
        finally:
            if reader is not None:
                reader.close()

    def prune_after(self, step: int | None) -> None:
        """Node leaders drop node-local steps newer than the one restored: a run restarted from an
        older step must not find the abandoned run's later steps at its next restart."""
        if self.topology.is_leader:
            try:
                newer = [s for s in self.level.committed_steps() if step is None or s > step]
            except Exception as exc:  # noqa: BLE001 (the restore is done: a node disk failing is not its failure)
                log.warning("statesnap: the node-local level at %s cannot be listed (%s); its steps after step %s "
                            "are left as they are", self.level.root, described(exc), step)
                return
            for later in newer:
                self.remove(later)

    def remove(self, step: int) -> None:
        """Node leaders drop the node-local copy of ``step`` (their own or a peer's replica)."""
        if self.topology.is_leader:
            self.level.remove_step(step)
