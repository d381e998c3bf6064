"""The background pipeline: stage (allocate, copy, check) then flush (checksum, write, fsync, commit).

Two threads keep the order that correctness needs, two pools do the bytes. The *stager* thread
takes snapshots in ``save()`` order, allocates arena space (blocking when the arena is full:
back-pressure) and hands batches to copy workers. The *flusher* thread takes persisted snapshots
in order, writes each batch as soon as its copy is done (write workers checksum and ``pwrite``),
fsyncs, and commits through the same steps as a blocking save: ``engine.save``'s staging, the
report to the tensors' owners and the atomic commit. Its only collectives run on a dedicated
group, one checkpoint after another, never on the trainer's process groups.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from ..engine.dist import Comm
from ..engine.replicas import REPLICA_CHECK_MB, hash_tensors, limit_bytes, replicas_to_check, sampled_items
from ..engine.save import RankOutput, commit_by_owners, committed_bytes, data_file_name, open_staging, own_objects
from ..errors import CheckpointError, described
from ..format.checksum import block_heads, checksum_blocks, checksum_whole
from ..format.manifest import BOX, ObjectEntry
from ..monitor.events import EventLog, now
from ..plan.save_plan import SavePlan, align_up
from ..state.items import Flattened, ItemMeta
from ..storage.base import StorageBackend
from .gpu import wait_for
from .hooks import Countdown, changed_since_save, check_unchanged, storage_base, version_of
from .staging import FREE, Arena, Batch, Region, build_batches, copy_into

log = logging.getLogger("statesnap")

UNGUARDED = "unguarded"  # the gate of the items no optimizer writes that save() waits for


class WatchedFuture(Future):
    """A Future that remembers whether ``result`` raised its failure: a loop that handled it there
    must not get it again from the next ``save`` or from ``close``. (``exception`` does not count:
    the integrations look at it to keep their own books, and leave the raising to the
    Checkpointer.)"""

    seen = False

    def result(self, timeout=None):
        try:
            return super().result(timeout)
        except BaseException as exc:  # (a wait that timed out is not the failure)
            self.seen = self.seen or (self.done() and not self.cancelled() and super().exception(0) is exc)
            raise


@dataclass(eq=False)
class Snapshot:
    """One checkpoint in flight: what ``save()`` recorded and how far the background got."""

    step: int
    flat: Flattened
    metas: list[ItemMeta]
    plan: SavePlan  # this rank's part (engine/save.py, plan_by_owners)
    elsewhere: dict  # item index -> (writer rank, writer's item index) of what another rank writes
    owned: Any  # the plan of the tensors this rank owns (plan/owners.py), which builds their entries
    persist: bool
    resident: bool
    versions: list
    storages: list  # per item: where its values lay at save() (``hooks.storage_of``)
    owners: list  # per item: the owner that writes it (an optimizer's id, hooks.owners_of), or None
    writers: frozenset  # the owners that write some item
    # items no optimizer writes that changed since the previous save: save() waits for their
    # copies (the UNGUARDED gate), as nothing would hold back their next change
    hot: frozenset
    # optimizer id -> its CPU items, whose version counters are looked at once more (``release``),
    # when the optimizer is about to step or the checkpoint is about to commit
    late_checks: dict
    resolved: list  # per item: no conjugate or negative bit (``state_cache.Layout``)
    plain: bool  # every item's counter is its ``_version`` (no DTensor or inference tensor)
    nbytes: int  # of all items
    objects: dict  # fqn -> ObjectEntry of every object (the memory level restores all of them)
    blobs: dict  # fqn -> pickled bytes
    per_rank: set
    object_digests: dict  # fqn -> hash of each shared value the commit compares across ranks
    cuda_ready: dict
    rank: int = 0
    local: bool = False  # also goes to the node-local level (checkpointer/local.py)
    committed: bool = False  # committed on the persistent level
    staged: Future = field(default_factory=Future)
    durable: WatchedFuture = field(default_factory=WatchedFuture)
    batches: queue.Queue = field(default_factory=queue.Queue)
    owner_keys: dict = field(default_factory=dict)  # optimizer id -> its owner (hooks.owners_of)
    gates: dict = field(default_factory=dict)  # owner -> Countdown
    copied: Countdown | None = None
    region: Region | None = None
    item_offsets: list = field(default_factory=list)
    error: BaseException | None = None
    reported: bool = False
    path: str = ""
    finished: threading.Event = field(default_factory=threading.Event)  # nothing of it runs any more
    released: set = field(default_factory=set)  # owners whose late checks are done (None: all of them)
    hot_queued: bool = False  # the copies of ``hot`` are all queued (the UNGUARDED gate's own count is done)
    _stages_left: int | None = None
    _bases: frozenset | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def storage_bases(self) -> frozenset:
        """The storages under its items (``hooks.storage_base``): an optimizer outside the state
        that writes one waits for its copy. Made at the first such step, not in ``save()``."""
        if self._bases is None:
            # (not 0: every empty tensor's, which an unrelated empty parameter shares)
            self._bases = frozenset(storage_base(item.local) for item in self.flat.tensors) - {0}
        return self._bases

    def was_reported(self) -> bool:
        """Whether its failure reached the caller: by ``SaveHandle.wait``, by a later call of the
        Checkpointer, or by ``durable.result()`` (the failure of ``staged``, a copy's, is raised
        again: the checkpoint's own outcome is ``durable``'s)."""
        return self.reported or self.durable.seen

    def stage_ended(self) -> bool:
        """A writing stage (persistent flush or node-local flush) is done with this snapshot;
        True for the last of them: then nothing reads its arena region any more."""
        with self._lock:
            self._stages_left = (int(self.persist) + int(self.local) if self._stages_left is None
                                 else self._stages_left) - 1
            return self._stages_left <= 0

    def fail(self, exc: BaseException) -> None:
        """Record the first failure and open every gate: nobody waits for a dropped checkpoint."""
        with self._lock:
            if self.error is not None:
                return
            self.error = exc
            for future in (self.staged, self.durable):
                if not future.done():
                    future.set_exception(exc)
        for gate in [*self.gates.values(), self.copied]:
            if gate is not None:
                gate.release()

    def owner_of(self, optimizer_id: int) -> int:
        return self.owner_keys.get(optimizer_id, optimizer_id)

    def release(self, owner=None) -> BaseException | None:
        """The last look at the version counters of ``owner``'s items (None: every one's), for
        the moment their writer may change them, or the checkpoint commits: on the CPU PyTorch
        moves a counter when an in-place operation ends, so the check right after a copy misses
        a change still under way, which it finds here. A change found fails the checkpoint.
        After this, changes to those items are their writer's own: nothing looks again."""
        with self._lock:
            if None in self.released or owner in self.released:
                return self.error
            owners = [o for o in self.late_checks if o not in self.released] if owner is None else [owner]
            self.released.add(owner)
            items, versions = self.flat.tensors, self.versions
            # (a thousand calls of version_of cost a step a millisecond; plain tensors need none)
            counter = (lambda t: t._version) if self.plain else version_of
            changed = next((i for o in owners for i in self.late_checks.get(o, ())
                            if versions[i] is not None and counter(items[i].local) != versions[i]), None)
        if changed is not None:
            self.fail(changed_since_save(items[changed].fqn, self.step))
        return self.error

    def mark_staged(self) -> None:
        with self._lock:
            if self.error is None and not self.staged.done():
                self.staged.set_result(self.step)

    def mark_durable(self, path: str | None) -> bool:
        """Resolve ``durable`` (``path``: committed there; None: kept in memory only), unless failed."""
        with self._lock:
            if self.error is not None or self.durable.done():
                return False
            self.durable.set_result(path)
            return True


def as_checkpoint_error(exc: BaseException, step: int, path: str) -> CheckpointError:
    if isinstance(exc, CheckpointError):
        return exc
    where = f" ({path})" if path else ""
    error = CheckpointError(f"checkpoint of step {step}{where} failed in the background and was not "
                            f"committed: {described(exc)}")
    error.__cause__ = exc
    return error


class _Stage:
    """A pipeline stage: one thread takes snapshots in order from a queue; a pool runs their
    parallel parts. Subclasses set their attributes, then call ``__init__``, which starts it.
    ``on_crash(snap)``: told of a snapshot a failure past the stage's own handling left behind."""

    on_crash = None

    def __init__(self, name: str, threads: int):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"statesnap-{name}")
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"statesnap-{name}-stage", daemon=True)
        self._thread.start()

    def submit(self, snap: Snapshot) -> None:
        self._queue.put(snap)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._pool.shutdown(wait=True)

    def _run(self) -> None:
        for snap in iter(self._queue.get, None):
            try:
                self._handle(snap)
            except BaseException as exc:  # noqa: BLE001
                # past the stage's own handling (a bug): fail this checkpoint but keep the thread,
                # or every later one would wait for it forever
                log.exception("statesnap: the background %s failed at step %d", self._thread.name, snap.step)
                snap.fail(CheckpointError(
                    f"checkpoint of step {snap.step} ({snap.path}) met an internal error in the background "
                    f"({type(exc).__name__}: {exc}); whether it was committed, a restart's load_latest tells"))
                if self.on_crash is not None:
                    self.on_crash(snap)

    def _handle(self, snap: Snapshot) -> None:
        raise NotImplementedError


class Stager(_Stage):
    """Allocates arena space for each snapshot in order and runs its copies on worker threads."""

    def __init__(self, arena_of, copy_threads: int, segment_bytes_of, events: EventLog,
                 on_copies_done, cuda_copier_of, on_stale_layout, file_order: bool = False):
        self._arena_of = arena_of  # () -> Arena (it may be replaced between snapshots)
        self._file_order = file_order  # storage that takes one stream per file (object stores)
        self._segment_bytes_of = segment_bytes_of
        self._events = events
        self._on_copies_done = on_copies_done  # (snap) once no copy of it runs any more
        self._cuda_copier_of = cuda_copier_of
        self._on_stale_layout = on_stale_layout  # () when a tensor no longer matches its description
        super().__init__("copy", copy_threads)

    def submit(self, snap: Snapshot) -> None:
        snap.copied = Countdown(on_zero=lambda: self._copies_done(snap))
        snap.gates = {owner: Countdown() for owner in (*snap.writers, *([UNGUARDED] if snap.hot else []))}
        super().submit(snap)

    def _handle(self, snap: Snapshot) -> None:
        try:
            self._stage(snap)
        except BaseException as exc:  # noqa: BLE001 (reported through the snapshot)
            snap.fail(as_checkpoint_error(exc, snap.step, snap.path))
        finally:
            snap.batches.put(None)
            for owner, gate in [*snap.gates.items(), (None, snap.copied)]:
                if owner != UNGUARDED or not snap.hot_queued:
                    gate.finish()

    def _stage(self, snap: Snapshot) -> None:
        arena: Arena = self._arena_of()
        items = snap.flat.tensors
        self._check_described(snap)
        sizes = [item.nbytes for item in items]
        writes = {index: offset for index, offset in snap.plan.writes[snap.rank]} if snap.persist else {}
        if self._file_order and writes:
            # An object store uploads each file as one stream: copies in file order keep its writer
            # from holding parts that arrive early (what it is not written comes last).
            # (Those save() waits for still come first.)
            order = sorted(range(len(items)), key=lambda i: (i not in snap.hot, writes.get(i, float("inf"))))
        else:
            # Tensors no optimizer changes go first (something else may touch them: those that
            # changed since the last save, which save() waits for, first of all), then by optimizer.
            order = sorted(range(len(items)), key=lambda i: (snap.owners[i] is not None, i not in snap.hot,
                                                             str(snap.owners[i])))
        splittable = [item.local.is_contiguous() for item in items]
        batches, snap.item_offsets = build_batches(order, sizes, splittable, snap.owners, writes,
                                                   snap.resident, self._segment_bytes_of())
        if snap.resident:
            end = batches[-1].arena_span[1] if batches else 0
            snap.region = self._allocate(arena, end, snap)
        hot = [batch for batch in batches if not snap.hot.isdisjoint(seg.item for seg in batch.segments)]
        for batch in hot:
            batch.owners.add(UNGUARDED)
        if not hot:
            self._hot_queued(snap)
        for batch in batches:
            if snap.error is not None:
                break
            if not snap.resident:
                batch.region = self._allocate(arena, batch.arena_span[1], snap)
            queued = now()
            try:
                on_device = self._queue_device_copies(arena, snap, batch)
            except BaseException as exc:  # noqa: BLE001 (the batch still goes on, to free its region)
                snap.fail(as_checkpoint_error(exc, snap.step, snap.path))
                on_device = []
            for owner in batch.owners:
                snap.gates[owner].add()
            snap.copied.add()
            snap.batches.put((batch, self._pool.submit(self._copy, arena, snap, batch, on_device, queued)))
            if hot and batch is hot[-1]:
                self._hot_queued(snap)

    @staticmethod
    def _hot_queued(snap: Snapshot) -> None:
        """Every copy ``save()`` waits for is queued (they come first): open its gate to them
        alone, not to the rest, which a snapshot larger than the arena queues only as space frees."""
        if UNGUARDED in snap.gates and not snap.hot_queued:
            snap.hot_queued = True
            snap.gates[UNGUARDED].finish()

    def _check_described(self, snap: Snapshot) -> None:
        """Every tensor still has the shape and size it was described with. ``save()`` reuses its
        descriptions while a cheap check passes (state_cache.py), and for a plain optimizer's
        state that check is identity: a ``resize_`` or a ``.data =`` of another shape since then
        would make the copy read past the tensor or store it under the wrong shape."""
        for item, meta in zip(snap.flat.tensors, snap.metas):
            if item.nbytes != meta.nbytes or (meta.layout == BOX and item.local.shape != meta.size):
                self._on_stale_layout()
                raise CheckpointError(
                    f"checkpoint of step {snap.step}: tensor {item.fqn!r} was changed in shape or dtype in place "
                    f"({list(meta.size)} {meta.dtype} when the state was last described, now "
                    f"{list(item.local.shape)} {str(item.dtype)[6:]}; resize_, set_ or .data = ...), so this "
                    "checkpoint was dropped; the next save() describes the state again")

    def _allocate(self, arena: Arena, nbytes: int, snap: Snapshot) -> Region:
        start = now()
        region = arena.allocate(nbytes)
        if now() - start > 1e-3:
            self._events.add("arena-wait", snap.step, start, now())
        return region

    def _queue_device_copies(self, arena: Arena, snap: Snapshot, batch: Batch) -> list:
        """Queue the batch's GPU copies on the side streams now, on this thread: the copy engine
        then has the next batches lined up while a worker waits for this one (gpu.py)."""
        items, base = snap.flat.tensors, (snap.region or batch.region).start
        copies = [(arena.view(base + seg.arena, seg.nbytes), items[seg.item].local, seg.offset)
                  for seg in batch.segments if items[seg.item].local.device.type == "cuda"]
        if not copies:
            return []
        copier = self._cuda_copier_of()
        try:
            return copier.enqueue(copies, snap.cuda_ready)
        except BaseException:
            copier.synchronize()  # what was queued before the failure must not write into a freed region
            raise

    def _copy(self, arena: Arena, snap: Snapshot, batch: Batch, on_device: list, queued: float) -> None:
        """Copy the batch's CPU tensors, wait for its GPU copies, then check nothing changed under them."""
        base = (snap.region or batch.region).start
        start = queued if on_device else now()  # GPU copies started when they were queued
        try:
            try:
                items = snap.flat.tensors
                for seg in batch.segments:
                    src = items[seg.item].local
                    if snap.error is None and src.device.type != "cuda":
                        copy_into(arena.view(base + seg.arena, seg.nbytes), src, seg.offset, snap.resolved[seg.item])
            finally:  # the region is released after this returns: no copy may still be writing to it
                wait_for(on_device)
            if snap.error is not None:
                return
            for item in {seg.item for seg in batch.segments}:
                check_unchanged(items[item].local, snap.versions[item], snap.storages[item], items[item].fqn,
                                snap.step)
            self._events.add("copy", snap.step, start, now(), sum(seg.nbytes for seg in batch.segments))
        except BaseException as exc:  # noqa: BLE001 (reported through the snapshot)
            snap.fail(as_checkpoint_error(exc, snap.step, snap.path))
        finally:
            for owner in batch.owners:
                snap.gates[owner].finish()
            snap.copied.finish()

    def _copies_done(self, snap: Snapshot) -> None:
        snap.mark_staged()
        self._on_copies_done(snap)


@dataclass
class FlushTarget:
    """Where and how the flusher writes: the persistent level's backend and the commit settings."""

    backend: StorageBackend
    comm: Comm
    durable: bool
    threads: int
    block_bytes_of: Any  # () -> int
    replica_check_bytes: int = limit_bytes(REPLICA_CHECK_MB)  # replicas compared at commit, up to this size


class Flusher(_Stage):
    """Writes persisted snapshots in order and commits them on all ranks together."""

    def __init__(self, target: FlushTarget, arena_of, events: EventLog, on_done):
        self.target = target
        self._arena_of = arena_of
        self._events = events
        self._on_done = on_done  # (snap, committed bytes or None) after each snapshot
        self.broken: BaseException | None = None  # a failed collective: later commits cannot agree
        super().__init__("write", target.threads)

    def _handle(self, snap: Snapshot) -> None:
        committed = None
        try:
            committed = self._flush(snap)
        except BaseException as exc:  # noqa: BLE001 (reported through the snapshot)
            snap.fail(as_checkpoint_error(exc, snap.step, snap.path))
        self._on_done(snap, committed)

    def _flush(self, snap: Snapshot) -> int:
        if self.broken is not None:
            self._drain(snap)
            raise CheckpointError(f"checkpoint of step {snap.step} skipped: an earlier commit could not reach "
                                  f"the other ranks ({self.broken}); restart the job from the last checkpoint")
        comm, backend = self.target.comm, self.target.backend
        opened = open_staging(backend, snap.path, True) if comm.rank == 0 else None
        try:
            staging, token, problem, first_step = comm.broadcast(None if opened is None else (*opened, snap.step))
        except BaseException as exc:
            if opened is not None and opened[0] is not None:  # no other rank heard of it: none wrote into it
                _remove_quietly(backend, opened[0], snap.path)
            self.broken = exc
            self._drain(snap)
            raise
        output, error = None, None
        try:
            if problem is not None:
                raise CheckpointError(f"could not start checkpoint {snap.path}: {problem}")
            if snap.step != first_step:  # (each rank flushes its snapshots in the order it took them)
                raise CheckpointError(
                    f"the ranks are out of step: rank {comm.rank}'s next checkpoint to write is of step {snap.step}, "
                    f"rank 0's of step {first_step} (a save() raised on some ranks and not on others, or they gave "
                    "different steps); a checkpoint of both would mix two steps, so none is committed until the job "
                    "restarts from the last checkpoint")
            output = self._write(snap, staging, token)
            self._drain(snap)  # every copy is done, also on a rank that writes nothing
            snap.release()
            output.replicas = hash_staged_replicas(snap, self._arena_of(), self.target.replica_check_bytes,
                                                   self.target.block_bytes_of(), self._events)
            output.object_digests = snap.object_digests
        except BaseException as exc:  # noqa: BLE001 (every rank must reach the gather below)
            error = snap.error or exc
        finally:
            self._drain(snap)
        error = error or snap.error
        try:
            result, error = commit_by_owners(
                comm, backend, snap.path, staging, token, snap.metas, snap.plan, snap.owned, output, error,
                overwrite=True, durable=self.target.durable, block_bytes=self.target.block_bytes_of(),
                meta={"step": snap.step}, timed=lambda: self._events.timed("commit", snap.step))
        except BaseException as exc:
            self.broken = exc
            raise
        if error is not None:
            raise error
        return committed_bytes(result, snap.path)

    def _drain(self, snap: Snapshot) -> None:
        """Wait for every copy of ``snap`` and free streaming regions not freed by a write."""
        arena = self._arena_of()
        for batch, future in iter(snap.batches.get, None):
            future.result()
            if batch.region is not None and batch.region.state != FREE:
                arena.release(batch.region)
        snap.batches.put(None)  # idempotent: a later drain finds the end at once

    def _write(self, snap: Snapshot, staging: str, token: str) -> RankOutput:
        backend, rank = self.target.backend, self.target.comm.rank
        entries, blobs = own_objects(snap.objects, snap.blobs, snap.per_rank, rank, snap.plan.object_writers)
        if not snap.plan.writes[rank] and not blobs:
            return RankOutput(None, 0, {}, entries, snap.per_rank)
        name = data_file_name(token, rank)
        writer = backend.open_write(backend.join(staging, name), self.target.durable)
        sums: dict[tuple[int, int], list[int]] = {}
        heads: dict[tuple[int, int], list[int]] = {}  # of the items a holder of a copy samples
        sampled = sampled_items(snap.metas, [item.replicated for item in snap.flat.tensors],
                                self.target.replica_check_bytes if self.target.comm.world_size > 1 else 0)
        pending = []
        try:
            for batch, copied in iter(snap.batches.get, None):
                copied.result()
                if snap.error is None and any(seg.file is not None for seg in batch.segments):
                    pending.append(self._pool.submit(self._write_batch, snap, batch, writer, sums, heads, sampled))
                elif batch.region is not None:
                    self._arena_of().release(batch.region)
            snap.batches.put(None)
            if snap.error is not None:
                raise snap.error
            for future in pending:
                future.result()
            end = self._write_blobs(writer, blobs, entries, snap.plan.file_bytes[rank])
        except BaseException:
            wait(pending)  # the file is closed only once no write uses it any more
            writer.close(durable=False)
            raise
        with self._events.timed("fsync", snap.step):
            writer.close(self.target.durable)
        return RankOutput(name, end, _by_item(sums), entries, snap.per_rank, heads=_by_item(heads))

    def _write_blobs(self, writer, blobs: list, entries: dict, end: int) -> int:
        """Pickled values (``allow_pickle``) go after the tensor data, as in a blocking save."""
        for fqn, blob in blobs:
            start = align_up(end)
            writer.pwrite(start, [memoryview(blob)])
            entries[fqn] = ObjectEntry("pickle", [None, start, len(blob), checksum_whole(memoryview(blob))])
            end = start + len(blob)
        return end

    def _write_batch(self, snap: Snapshot, batch: Batch, writer, sums: dict, heads: dict, sampled: set[int]) -> None:
        arena = self._arena_of()
        base = (snap.region or batch.region).start
        try:
            segments = [seg for seg in batch.segments if seg.file is not None]
            views = [arena.view(base + seg.arena, seg.nbytes).numpy().data for seg in segments]
            nbytes = sum(seg.nbytes for seg in segments)
            with self._events.timed("checksum", snap.step, nbytes):
                block = self.target.block_bytes_of()
                for seg, view in zip(segments, views):
                    sums[(seg.item, seg.offset)] = checksum_blocks([view], block)
                    if seg.item in sampled:
                        heads[(seg.item, seg.offset)] = block_heads(view, block)
            with self._events.timed("write", snap.step, nbytes):
                for seg, view in zip(segments, views):
                    writer.pwrite_bulk(seg.file, view)
        finally:
            if batch.region is not None:
                arena.release(batch.region)


def _by_item(parts: dict[tuple[int, int], list[int]]) -> dict[int, list[int]]:
    """Per item, the values of its segments ((item, offset) -> values) in the order of their offsets."""
    out: dict[int, list[int]] = {}
    for (item, _offset), values in sorted(parts.items()):
        out.setdefault(item, []).extend(values)
    return out


def _remove_quietly(backend, staging: str, final: str) -> None:
    """Remove a staging location on the way out of a failure, which stays the error raised: one
    left behind (storage unreachable) is removed by the next Checkpointer on the root."""
    try:
        backend.abort(staging, final)
    except Exception as exc:  # noqa: BLE001
        log.warning("statesnap: could not remove %s after a failed commit (%s); the next Checkpointer on the "
                    "root removes it", staging, described(exc))


def hash_staged_replicas(snap: Snapshot, arena, limit: int, block_bytes: int, events) -> list:
    """Hashes of the staged copies of this rank's replicas of pieces other ranks write (of at
    most ``limit`` bytes whole, larger ones sampled), which the commit compares with the writers'
    checksums (``engine/replicas.py``). Hashing the arena, in a flush stage, keeps the work off
    the training thread and sees exactly the snapshot. Only a resident snapshot has them there:
    a streaming one stages just what this rank writes."""
    if not snap.resident or snap.error is not None:
        return []
    targets = replicas_to_check(snap.elsewhere, snap.metas, [item.replicated for item in snap.flat.tensors], limit)
    if not targets:
        return []
    base = snap.region.start
    staged = {index: arena.view(base + snap.item_offsets[index], snap.metas[index].nbytes) for index, *_ in targets}
    with events.timed("checksum", snap.step, sum(view.numel() for view in staged.values())):
        return hash_tensors(targets, staged, block_bytes)
