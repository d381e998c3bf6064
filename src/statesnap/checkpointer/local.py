"""The node-local level and its peer replicas.

Every ``local_every``-th step is also written to node-local storage (an NVMe path or ``shm://``),
as a committed statesnap checkpoint per node: ``<local_root>/<job>/step-N`` (``job_directory``)
holds the job's whole manifest and the data files of that node's ranks. With ``peer_replicas=1``
each rank also sends its data file, straight from the staging arena, to a partner rank on the
next node, which writes it into its own node's ``step-N`` before that node commits. Losing any
one node then leaves every file on some other node, and a restart reads them from there
(``recovery.py``) instead of from ``root``.

Collectives and transfers run on a dedicated gloo group, on this stage's own thread, never on the
trainer's groups. A receiver takes the bytes through one bounce buffer whose size the arena gives
up (``peer_buffer_bytes``): the replica counts against the host budget, and the arena keeps the
snapshot itself until this stage is done with it, as it does for the persistent flush.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import posixpath
import re
import socket
import uuid
import warnings
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..engine.dist import Comm
from ..engine.replicas import heads_of, mismatches, sampled_items
from ..engine.save import (RankOutput, data_file_name, gather_reports, own_objects, report_errors, whole_manifest,
                           write_rank)
from ..errors import CheckpointError, described
from ..format.manifest import MANIFEST_NAME
from ..monitor.events import EventLog, now
from ..storage import is_url
from .config import CheckpointerConfig
from .levels import StorageLevel
from .pipeline import Snapshot, _Stage, hash_staged_replicas

log = logging.getLogger("statesnap")

PEER_CHUNK_BYTES = 8 << 20  # transfers go in pieces of this size,
IN_FLIGHT = 2  # this many at a time: one is written (or read) while the next is on the wire


def job_directory(local_root: str, root: str, backend) -> str:
    """This job's node-local level: ``<local_root>/<root's last name>-<digest of root>``. A node
    keeps one local_root for every job it runs (a fixed NVMe path in the launch script): with the
    steps of every job in one directory, a new run (another root) restored the last run's weights
    and plain values as its own, and its retention deleted its own steps as older than those.
    Each job's directory is named after its persistent root, the job's identity across restarts,
    in one spelling of it (``_identity``)."""
    root = _identity(root)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", root.rsplit("/", 1)[-1]).lstrip(".")[:40] or "root"
    return backend.join(local_root, f"{name}-{hashlib.sha256(root.encode()).hexdigest()[:12]}")


def _identity(root: str) -> str:
    """``root`` as every spelling of it reads: a restart that wrote ``s3://b/run/`` for
    ``s3://b/run`` (or ``S3://b//run``), or reached a local root through a link, looked in
    another directory, and restored from root the steps its node-local level held newer."""
    if not is_url(root):
        return os.path.realpath(root)
    scheme, _, rest = root.partition("://")
    return f"{scheme.lower()}://{posixpath.normpath(rest) if rest.strip('/') else ''}"


def peer_buffer_bytes(host_memory_bytes: int) -> int:
    """The receiver's bounce buffer taken out of the host budget: room for the chunks in flight
    (16 MiB), or an eighth of a small budget (chunks then arrive in buffers of their own)."""
    return max(4096, min(IN_FLIGHT * PEER_CHUNK_BYTES, host_memory_bytes // 8))


@dataclass
class Topology:
    """Which node each rank of the group is on (from torchrun's ``GROUP_RANK`` or ``node_id``)."""

    nodes: list[int]
    rank: int

    def leader(self, rank: int) -> int:
        """The lowest rank on ``rank``'s node: it creates, commits and prunes that node's steps."""
        return min(r for r, n in enumerate(self.nodes) if n == self.nodes[rank])

    @property
    def is_leader(self) -> bool:
        return self.leader(self.rank) == self.rank

    def partners(self) -> list[int | None]:
        """Each rank's partner: the rank of the same index on the next node (cyclically), so a
        rank's replica is never on its own node; None for all when there is one node."""
        distinct = sorted(set(self.nodes))
        if len(distinct) < 2:
            return [None] * len(self.nodes)
        members = {n: [r for r, m in enumerate(self.nodes) if m == n] for n in distinct}
        out = []
        for rank, node in enumerate(self.nodes):
            following = members[distinct[(distinct.index(node) + 1) % len(distinct)]]
            out.append(following[members[node].index(rank) % len(following)])
        return out


def without_peer_replicas(cfg: CheckpointerConfig, comm: Comm) -> CheckpointerConfig:
    """``cfg`` without peer replicas, for ``peer_replicas=1`` on ranks that all say they are on one
    node. On one host that is a restart on the node a lost one left (the configuration unchanged,
    as at 3 a.m. it is): refusing it kept the job from restoring the replicas this node holds.
    So it runs without replicas and says so. Ranks on several hosts that report one node are
    misconfigured: their node-local levels would be taken for one, so that is refused."""
    hosts = set(comm.all_gather(socket.gethostname()))
    if len(hosts) > 1:
        raise CheckpointError(f"peer_replicas={cfg.peer_replicas} needs ranks on at least two nodes, but every "
                              f"rank says it is on node {cfg.node_id}, on {len(hosts)} hosts: set GROUP_RANK "
                              "or node_id= to each rank's node")
    message = (f"statesnap: peer_replicas={cfg.peer_replicas}, but every rank is on node {cfg.node_id}: no other "
               "node can keep replicas, so this run keeps none (a node-local checkpoint is then lost with its "
               "node; the persistent level keeps its own copies). Restores still read the replicas kept here.")
    log.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=4)
    return dataclasses.replace(cfg, peer_replicas=0)


# ----------------------------------------------------------------- byte streams between two ranks


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def send_stream(group, dst: int, ranges: list[tuple[int, int]], read) -> None:
    """Send byte ranges ``(offset, nbytes)`` of a file; ``read(offset, nbytes)`` gives a uint8
    tensor of at most a chunk, which must stay as it is until ``IN_FLIGHT`` more reads were
    made: chunks go out that many at a time, so the next one is read while the last is on the
    wire (a reader into a buffer takes its slots in turn). ``ranges`` None says the sender has nothing
    (it failed). A read that fails halfway does not stop the stream, which would leave the
    receiver waiting until the group's timeout: zeros stand in for the rest, and the failure is
    raised at the end (the caller then fails the transfer on every rank, so the zeros are never
    used)."""
    dst = _global(group, dst)
    if ranges is None:
        dist.send(torch.tensor([-1], dtype=torch.int64), dst, group)
        return
    dist.send(torch.tensor([len(ranges)], dtype=torch.int64), dst, group)
    if ranges:
        dist.send(torch.tensor(ranges, dtype=torch.int64), dst, group)
    failure, sending = None, deque()
    for position, nbytes in _chunks(ranges):
        if len(sending) == IN_FLIGHT:
            sending.popleft().wait()
        chunk = None
        if failure is None:
            try:
                chunk = read(position, nbytes)
            except Exception as exc:  # noqa: BLE001 (raised once the stream is sent)
                failure = exc
        sending.append(dist.isend(chunk if chunk is not None else torch.zeros(nbytes, dtype=torch.uint8), dst, group))
    while sending:
        sending.popleft().wait()
    if failure is not None:
        raise failure


def recv_stream(group, src: int, buffer: torch.Tensor, write) -> bool:
    """Receive what :func:`send_stream` sends; ``write(offset, uint8 tensor)`` takes each chunk
    while the next ones arrive, in the other slots of ``buffer`` (None: receive and drop). False
    if the sender had nothing to send. A ``write`` that fails does not stop the receiving: the
    sender would wait for it until the group's timeout, so the rest is received and dropped,
    and the failure is raised at the end."""
    src = _global(group, src)
    failure = None
    count = torch.empty(1, dtype=torch.int64)
    dist.recv(count, src, group)
    if int(count) < 0:
        return False
    table = torch.empty((int(count), 2), dtype=torch.int64)
    if int(count):
        dist.recv(table, src, group)
    slots = [buffer[k:k + PEER_CHUNK_BYTES] for k in range(0, buffer.numel(), PEER_CHUNK_BYTES)][:IN_FLIGHT]
    arriving = deque()

    def land() -> None:
        nonlocal failure
        position, view, work = arriving.popleft()
        work.wait()
        if write is not None and failure is None:
            try:
                write(position, view)
            except Exception as exc:  # noqa: BLE001 (raised once the stream is drained)
                failure = exc
    for index, (position, nbytes) in enumerate(_chunks(table.tolist())):
        if len(arriving) == IN_FLIGHT:  # the chunk that last used this slot is written first
            land()
        slot = slots[index % IN_FLIGHT] if len(slots) == IN_FLIGHT else None
        view = slot[:nbytes] if slot is not None and slot.numel() >= nbytes else torch.empty(nbytes, dtype=torch.uint8)
        arriving.append((position, view, dist.irecv(view, src, group)))
    while arriving:
        land()
    if failure is not None:
        raise failure
    return True


def stream_buffer() -> torch.Tensor:
    """Room for the chunks of one stream in flight (``send_stream``, ``recv_stream``)."""
    return torch.empty(IN_FLIGHT * PEER_CHUNK_BYTES, dtype=torch.uint8)


def _chunks(ranges: list) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` ranges cut into the stream's chunks of at most ``PEER_CHUNK_BYTES``."""
    return [(offset + k, min(PEER_CHUNK_BYTES, nbytes - k)) for offset, nbytes in ranges
            for k in range(0, nbytes, PEER_CHUNK_BYTES)]


def pwriter(writer):
    """``write(offset, tensor)`` for :func:`recv_stream` onto a storage ``FileWriter``."""
    return lambda offset, view: writer.pwrite(offset, [memoryview(view.numpy())])


# ----------------------------------------------------------------- the stage


class LocalFlusher(_Stage):
    """Writes node-local snapshots in order: own file, replica exchange, manifest, per-node commit."""

    def __init__(self, level: StorageLevel, comm: Comm, topology: Topology, peers: bool, arena_of,
                 block_bytes_of, durable: bool, threads: int, buffer_bytes: int, events: EventLog, on_done,
                 replica_check_bytes: int):
        self.level, self.comm, self.topology = level, comm, topology
        # Replicas and shared values are compared here as for the persistent level: this level too
        # stores one copy and restores it to every rank, so a per-rank value not wrapped in
        # ss.PerRank gave every rank one rank's value after a restart, without a word.
        self._replica_check_bytes = replica_check_bytes if comm.world_size > 1 else 0
        self._partners = topology.partners() if peers else [None] * len(topology.nodes)
        self._arena_of, self._block_bytes_of = arena_of, block_bytes_of
        self._durable, self._threads, self._events, self._on_done = durable, threads, events, on_done
        self._buffer = torch.empty(buffer_bytes, dtype=torch.uint8) if peers else None
        super().__init__("local", 1)

    def _handle(self, snap: Snapshot) -> None:
        error = None
        start = now()
        try:
            nbytes = self._flush(snap)
            self._events.add("local", snap.step, start, now(), nbytes)
        except BaseException as exc:  # noqa: BLE001 (reported at the next call, not through the snapshot:
            error = exc               # the persistent flush of the same step goes on)
        self._on_done(snap, error)

    def _flush(self, snap: Snapshot) -> int:
        comm, backend, topo = self.comm, self.level.backend, self.topology
        final = self.level.path(snap.step)
        token = comm.broadcast(uuid.uuid4().hex[:12] if comm.rank == 0 else None)
        staging, problem = None, None
        if topo.is_leader:
            try:
                staging = backend.begin(final, token)
            except Exception as exc:  # noqa: BLE001 (every rank learns it below)
                problem = f"rank {comm.rank}: cannot start {final}: {described(exc)}"
        starts = comm.all_gather((staging, problem, snap.step))
        staging = starts[topo.leader(comm.rank)][0]
        steps = sorted({step for *_, step in starts})
        error, output = None, None
        try:
            problems = [p for _, p, _ in starts if p is not None] + ([
                f"the ranks are out of step: their next node-local checkpoints are of steps {steps} (a save() "
                "raised on some ranks and not on others); none is committed until the job restarts"]
                if len(steps) > 1 else [])
            if problems:
                raise CheckpointError("; ".join(problems))
            snap.copied.wait()
            if snap.error is not None:
                raise snap.error
            if not snap.resident:
                raise CheckpointError(f"step {snap.step} does not fit in host memory whole, which the "
                                      "node-local level copies from; raise host_memory_gb")
            output = self._write_own(snap, staging, token)
            failed = snap.release()  # (the last look at the counters, before this level commits)
            if failed is not None:
                raise failed
            output.replicas = hash_staged_replicas(snap, self._arena_of(), self._replica_check_bytes,
                                                   self._block_bytes_of(), self._events)
            output.object_digests = snap.object_digests
        except BaseException as exc:  # noqa: BLE001 (every rank must reach the exchange and the gather)
            error = exc
        try:
            self._exchange(snap, staging, token, output if error is None else None)
        except BaseException as exc:  # noqa: BLE001
            error = error or exc
        gathered, error = gather_reports(comm, snap.metas, snap.plan, snap.owned, output, error)
        result = self._manifest(snap, gathered) if comm.rank == 0 else None
        result = comm.broadcast(result)
        commit_failed = None
        if topo.is_leader and staging is not None:
            try:
                if isinstance(result, bytes):
                    backend.write_bytes(backend.join(staging, MANIFEST_NAME), result, self._durable)
                    backend.commit(staging, final, True, self._durable, keep=backend.listdir(staging))
                else:
                    backend.abort(staging, final)
            except Exception as exc:  # noqa: BLE001 (every rank learns below whether every node committed)
                commit_failed, error = exc, error or exc
        if isinstance(result, bytes):
            self._retain_once_whole(snap.step, commit_failed)
        if error is not None:
            raise error
        if not isinstance(result, bytes):
            raise CheckpointError(result)
        return output.file_bytes if output is not None else 0

    def _retain_once_whole(self, step: int, failed: BaseException | None) -> None:
        """Retention on this node once every node has committed ``step``: a node that deleted its
        older steps after its own commit, while another node's commit was cut short, left no step
        that the nodes held whole (``local_keep_last=1``). The step just committed is spared even
        when it is not the highest (a run that went back), and the level warns of the later ones."""
        if not self.comm.any_of([failed is not None])[0] and self.topology.is_leader:
            self.level.retain({step}, step)

    def _manifest(self, snap: Snapshot, gathered: list) -> bytes | str:
        """The whole manifest (every node's copy describes the job) from the owners' entries."""
        failures = [f"rank {r}: {err}" for r, err in enumerate(report_errors(gathered)) if err is not None]
        if failures:
            return (f"node-local checkpoint of step {snap.step} under {self.level.root} failed and was not "
                    "committed: " + "; ".join(failures))
        differ = mismatches([report.output for report in gathered],
                            {fqn: parts for report in gathered for fqn, parts in report.differing.items()})
        if differ is not None:
            return f"node-local checkpoint of step {snap.step} under {self.level.root} was not committed: {differ}"
        tables = {fqn: entry for report in gathered for fqn, entry in report.entries.items()}
        return whole_manifest(tables, [report.output for report in gathered], self.comm.world_size,
                              self._block_bytes_of(), {"step": snap.step})[1]

    def _write_own(self, snap: Snapshot, staging: str, token: str) -> RankOutput:
        """This rank's data file, as the persistent flush writes it, from the resident snapshot."""
        arena, base, rank = self._arena_of(), snap.region.start, self.comm.rank
        tensors = [arena.view(base + offset, meta.nbytes) for offset, meta in zip(snap.item_offsets, snap.metas)]
        entries, blobs = own_objects(snap.objects, snap.blobs, snap.per_rank, rank, snap.plan.object_writers)
        output = write_rank(self.level.backend, staging, token, rank, snap.plan, tensors, entries, blobs,
                            snap.per_rank, self._durable, self._threads, self._block_bytes_of())
        # the samples of large pieces that holders of copies compare (as the persistent flush takes them)
        sampled = sampled_items(snap.metas, [item.replicated for item in snap.flat.tensors], self._replica_check_bytes)
        output.heads = {index: heads_of(tensors[index], self._block_bytes_of())
                        for index, _ in snap.plan.writes[rank] if index in sampled}
        return output

    def _exchange(self, snap: Snapshot, staging: str, token: str, output: RankOutput | None) -> None:
        """Every rank sends its file to its partner, transfer after transfer in rank order: a
        rank's sends and receives come in the same global order on every rank, so none waits on
        a peer that waits on it. Whatever fails on one side, every transfer is still sent and
        received whole (or as "nothing"), and the first failure is raised at the end: a side
        that stopped halfway would leave the other waiting until the group's timeout, with the
        snapshot's arena space held all that while."""
        group, rank = self.comm.transport() if self.comm.world_size > 1 else None, self.comm.rank
        failures = []
        for src, dst in enumerate(self._partners):
            if dst is None or rank not in (src, dst):
                continue
            if rank == src:
                try:
                    ranges, read = self._own_ranges(snap, staging, output)
                except Exception as exc:  # noqa: BLE001 (the partner is told there is nothing)
                    failures.append(exc)
                    ranges, read = None, None
                send_stream(group, dst, ranges, read)
            else:
                self._receive(group, src, staging, token, failures)
        if failures:
            raise failures[0]

    def _receive(self, group, src: int, staging: str | None, token: str, failures: list) -> None:
        """Write ``src``'s replica into this node's staging; a failed open or write is recorded
        in ``failures`` while the stream is still received to its end."""
        writer = None
        try:
            if staging:
                writer = self.level.backend.open_write(
                    self.level.backend.join(staging, data_file_name(token, src)), self._durable)
        except Exception as exc:  # noqa: BLE001
            failures.append(exc)
        try:
            recv_stream(group, src, self._buffer, pwriter(writer) if writer else None)
        except Exception as exc:  # noqa: BLE001 (a failed write; a broken transport fails the gather next)
            failures.append(exc)
            # a transport that broke mid-stream may still complete a receive into the old buffer
            self._buffer = torch.empty_like(self._buffer)
        finally:
            if writer is not None:
                writer.close(self._durable)

    def _own_ranges(self, snap: Snapshot, staging: str, output: RankOutput | None):
        """What this rank's file holds, as ranges, and a reader: tensors from the arena, pickled
        values (after them in the file) from the file just written, read before anything is sent
        so that no read can fail halfway through the stream."""
        if output is None:
            return None, None
        if output.file is None:
            return [], None
        arena, base, plan, rank = self._arena_of(), snap.region.start, snap.plan, self.comm.rank
        # (an empty piece holds no bytes, and may start where the next one does: keyed by its
        # offset, it sent its neighbour's bytes from its own place in the arena)
        written = [(index, offset) for index, offset in plan.writes[rank] if snap.metas[index].nbytes]
        where = {offset: snap.item_offsets[index] for index, offset in written}
        ranges = [(offset, snap.metas[index].nbytes) for index, offset in written]
        tail_start = plan.file_bytes[rank]
        tail = torch.empty(output.file_bytes - tail_start, dtype=torch.uint8)
        if tail.numel():
            ranges.append((tail_start, tail.numel()))
            reader = self.level.backend.open_read(self.level.backend.join(staging, output.file))
            try:
                if reader.readinto(tail_start, [memoryview(tail.numpy())]) != tail.numel():
                    raise CheckpointError(f"{output.file} under {staging} is shorter than it was written")
            finally:
                reader.close()
        starts = sorted(where)

        def read(offset: int, nbytes: int) -> torch.Tensor:
            if offset >= tail_start:  # pickled values
                return tail[offset - tail_start:offset - tail_start + nbytes]
            item_start = max(s for s in starts if s <= offset)
            return arena.view(base + where[item_start] + offset - item_start, nbytes)
        return ranges, read
