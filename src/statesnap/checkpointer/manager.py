"""``ss.Checkpointer``: lazy asynchronous multi-level checkpoints for a training loop.

``save(step, state)`` records what to copy and returns; the copies run while the next forward and
backward run, and a torch optimizer's step waits only for the tensors it is about to change
(``hooks`` says what else is held back, and what cannot be). Every snapshot stays in host memory
(the memory level) while the arena has room; every ``persist_every``-th goes to ``<root>/step-N``;
an optional further level gets a copy of every ``further_every``-th. Failures in the background
surface at the next ``save``, ``wait_staged``, ``load_latest`` or ``close``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import warnings
from collections import deque
from concurrent.futures import Future

import torch
import torch.distributed as dist

from ..engine.dist import Comm, PeerLostError, destroy_group, timed_group
from ..engine.load import CAST_HINT
from ..engine.replicas import limit_bytes, object_digests
from ..engine.save import encode_objects, per_rank_names, plan_by_owners, shared_names
from ..engine.write import default_threads
from ..errors import CheckpointError, ConsistencyError, StateMismatchError, explained
from ..monitor.events import EventLog, now
from ..state.optim_state import create_adam_state
from ..storage import backend_for, is_url, normalize
from .at_exit import finish_at_exit
from .config import CheckpointerConfig
from .gpu import CudaCopier, mark_devices
from .handle import SaveHandle, not_sent, step_number
from .hooks import StepGuard, find_writers
from .further import FurtherCopier
from .levels import MemoryLevel, StorageLevel
from .local import LocalFlusher, Topology, job_directory, peer_buffer_bytes, without_peer_replicas
from .recovery import LocalRecovery
from .restore import load_newest
from .roots import RootClaims
from .pipeline import UNGUARDED, Flusher, FlushTarget, Snapshot, Stager, as_checkpoint_error
from .staging import MAX_SEGMENT_BYTES, REGION_ALIGN, Arena, align_up, segment_of
from .state_cache import StateCache

log = logging.getLogger("statesnap")
LOAD_LATEST_ADVICE = ("load_latest restores the whole state: build the model and optimizer the checkpoint was saved "
                      "with, or load what matches with ss.load(state, <that step's path>, strict=False).")


class Checkpointer:
    """``Checkpointer(root, keep_last=3, host_memory_gb=..., persist_every=1, ...)``; the settings
    are the fields of :class:`CheckpointerConfig`. Use one per training run; ``close`` it (or use
    it as a context manager) so the last checkpoints finish."""

    def __reduce__(self):
        raise not_sent(self)

    def __init__(self, root, **settings):
        self.config = cfg = CheckpointerConfig.of(root, settings)
        root = normalize(cfg.root)
        backend = cfg.backend or backend_for(root, cfg.storage_options)
        self.persistent = StorageLevel("persistent", root, backend, cfg.keep_last)
        self.further = None
        if cfg.further_root is not None:
            further_root = normalize(cfg.further_root)
            self.further = StorageLevel("further", further_root, backend_for(further_root, cfg.storage_options),
                                        cfg.further_keep_last)
        self.local = None
        if cfg.local_root is not None:
            local_root = normalize(cfg.local_root)
            local_backend = backend_for(local_root, cfg.storage_options)
            self.local = StorageLevel("local", job_directory(local_root, root, local_backend), local_backend,
                                      cfg.local_keep_last)
        self.memory = MemoryLevel()
        self.loaded_from: str | None = None  # the level the last load_latest restored from
        # the trainer's group: only on the training thread
        self._comm = Comm(cfg.process_group, f"the Checkpointer of {root}", cfg.commit_timeout_s)
        self._side_comms: list[Comm] = []  # (released at close)
        self._group, flush_comm = self._side_comm(f"committing to {root}")
        self.rank = self._comm.rank
        self._local_group = self._recovery = None
        if self.local is not None:
            self._start_local_level()
        # shared plain values are compared across ranks at each commit (engine/replicas.py)
        self._compares_objects = self._comm.world_size > 1 and cfg.replica_check_mb > 0
        self._roots = RootClaims([level for level in (self.persistent, self.further) if level is not None],
                                 self.local, self._comm, cfg)
        try:
            self._roots.claim_shared()
            if self.local is not None:
                self._roots.claim_local(self._local_leader, self._recovery.comm)
        except BaseException:
            self._destroy_side_group()
            raise
        try:
            self._start(cfg, root, flush_comm)
        except BaseException:  # (the roots stay claimed otherwise: the next Checkpointer on them is refused)
            self._roots.release()
            self._destroy_side_group()
            raise

    def _destroy_side_group(self) -> None:
        if self._group is not None:
            destroy_group(self._group)

    def _start(self, cfg: CheckpointerConfig, root: str, flush_comm: Comm) -> None:
        """The event log and the background stages, once the roots are claimed."""
        # the event log lives in the root; while that is out, in the node-local one
        events_level = self.persistent if self.persistent.unreachable is None else self.local
        events_path = None
        if cfg.events and not is_url(events_level.root):
            events_path = events_level.backend.join(events_level.root, "events", f"rank-{self.rank:05d}.jsonl")
        try:
            self.events = EventLog(self.rank, events_path)
        except OSError as exc:
            raise CheckpointError(f"cannot keep checkpoints under {events_level.root}: {explained(exc)}") from exc
        self._arena: Arena | None = None
        self._segment_bytes = MAX_SEGMENT_BYTES
        self._block_bytes = cfg.block_bytes
        self._cuda: CudaCopier | None = None
        self._plan_key, self._plan = None, None
        self._fits_key, self._all_fit = None, False  # _fits_everywhere's answer, and the layout it is for
        self._state_cache = StateCache()  # the flattened state, reused while its layout stays
        self._inflight: deque[Snapshot] = deque()
        self._failed: list[tuple[Snapshot | None, CheckpointError]] = []
        self._copying_further: set[int] = set()
        self._last_committed: int | None = None  # spared by retention after a further copy too
        self._lock = threading.Lock()
        self._saving = threading.RLock()
        self._in_on_commit = threading.local()
        self._pid = os.getpid()  # a forked child has none of this Checkpointer's threads
        self._counts = {"committed": 0, "memory_only": 0, "skipped": 0, "failed": 0}
        self._warned_streaming = False
        self._closed = False
        self._closing = False
        self._guard = StepGuard(self._gates_for, lambda step, s, e: self.events.add("wait-in-hook", step, s, e),
                                self._release_inflight, self._copying)
        self._stager = Stager(lambda: self._arena, cfg.copy_threads, lambda: self._segment_bytes, self.events,
                              self._copies_done, lambda: self._cuda, lambda: self._state_cache.forget(),
                              file_order=is_url(root))
        target = FlushTarget(self.persistent.backend, flush_comm, cfg.durable, cfg.threads or default_threads(),
                             lambda: self._block_bytes, limit_bytes(cfg.replica_check_mb))
        self._flusher = Flusher(target, lambda: self._arena, self.events, self._flushed)
        self._further_group = self._further_copier = None
        if self.further is not None:
            what = f"copies to {self.further.root}"
            self._further_group, comm = self._side_comm(what)
            self._further_copier = FurtherCopier(self.persistent, self.further, comm, cfg.durable, self.events,
                                                 self._further_done, self._roots.try_claim)
        self._local_flusher = None
        if self.local is not None:
            self._local_flusher = LocalFlusher(
                self.local, self._recovery.comm, self._recovery.topology, self.config.peer_replicas > 0,
                lambda: self._arena, lambda: self._block_bytes, cfg.durable, cfg.threads or default_threads(),
                peer_buffer_bytes(cfg.host_memory_bytes), self.events, self._local_done,
                limit_bytes(cfg.replica_check_mb))
        for stage in (self._stager, self._flusher, self._local_flusher):
            if stage is not None:
                stage.on_crash = self._abandon
        finish_at_exit(self, Checkpointer._finish_at_exit)

    # ----------------------------------------------------------------- training-thread API

    def save(self, step: int, state: dict) -> SaveHandle:
        """Snapshot ``state`` as step ``step`` and return at once (no tensor byte is copied here).
        Saves from several threads are taken one at a time. ``on_commit``, which runs on the
        thread that committed, may not save (that save could wait for the commit it runs in)."""
        self._check_open()  # (before the lock, which a fork may have copied held)
        self._refuse_in_on_commit("save()")
        with self._saving:  # (two first saves at once made an arena each, and a step was written from the other)
            return self._save(step, state)

    def _save(self, step: int, state: dict) -> SaveHandle:
        step = step_number(step)
        self._check_open()
        # An earlier step's failure is reported once this step is taken: raised before it, it left
        # a loop that logs the error and goes on without this step, and without a word about it.
        failure = self._take_failures()
        try:
            handle = self._take(step, state)
        except Exception:
            if failure is not None:
                self._report(failure)  # (the failure to take this step is its context)
            raise
        except BaseException:  # Ctrl-C, SystemExit: they stop the loop; the failure waits for the next call
            if failure is not None:
                with self._lock:
                    self._failed.append((None, failure))
            raise
        if failure is not None:
            self._report(failure)
        return handle

    def _take(self, step: int, state: dict) -> SaveHandle:
        started = now()
        self._wait_for_slot(step)
        self._check_open()  # (closed by another thread meanwhile)
        snap = self._queue(step, state, started)
        if snap is None:
            done = Future()
            done.set_result(None)
            return SaveHandle(step, done, done)
        if snap.hot:  # (the stager copies them first)
            with self.events.timed("wait-unguarded", step):
                snap.gates[UNGUARDED].wait()
        self.events.add("save", step, started, now(), snap.nbytes)
        return SaveHandle(snap.step, snap.staged, snap.durable, snap)

    def _queue(self, step: int, state: dict, started: float) -> Snapshot | None:
        """Plan the snapshot of ``state`` and hand it to the background stages (None: skipped)."""
        optimizers, wrappers = find_writers(state)
        # optimizers hooked before (found in an earlier state, or given to guard()) write what
        # they own in this state too, and wait for it
        optimizers += [optim for optim in self._guard.watched() if all(optim is not o for o in optimizers)]
        if self._comm.world_size > 1:
            # Ranks plan a new layout together, and an optimizer creates a parameter's state at
            # its first gradient, which some ranks may reach steps after the others (an expert
            # no token reached): those would change layout alone. All of it from the start
            # instead, as the optimizer itself would make it.
            for optim in optimizers:
                create_adam_state(optim)
        with self.events.timed("plan", step):
            snap = self._snapshot(int(step), state, optimizers, trust_guards=bool(wrappers) or self._guard.guards_methods())
        if snap is None:
            self._count("skipped")
            self.events.add("save", step, started, now())
            return None
        self._guard.watch(optimizers, wrappers)
        stages = [self._stager, *([self._flusher] if snap.persist else []),
                  *([self._local_flusher] if snap.local else [])]
        handed = 0
        try:
            with self._lock:
                if self._closing:  # close() began while this save planned: its threads take no more work
                    raise CheckpointError(f"this Checkpointer was closed while step {step} was being saved; "
                                          "the step was not saved")
                self._inflight.append(snap)  # close() waits for it from here on
            for stage in stages:
                stage.submit(snap)
                handed += 1
        except BaseException:
            # A Ctrl-C (or a signal handler's exception) in the hand-off: the stages that lack the
            # snapshot get it still, or close() waited forever for a snapshot no stage had.
            with self._lock:
                queued = snap in self._inflight
            for stage in stages[handed:] if queued else ():
                stage.submit(snap)
            raise
        return snap

    def remove(self, step: int) -> None:
        """Delete step ``step`` from every level, the way retention deletes (a checkpoint leaves
        the namespace in one rename, then its bytes go), after waiting for it if it is in flight,
        its copy to the further level included. Every rank calls it: rank 0 deletes on the
        shared levels, node leaders the node-local copy, each rank its host-memory copy.

        From every level, because a removed step is one the caller no longer wants restored (a
        run rolled back past weights gone bad): ``load_latest`` must not bring it back from
        memory or a node's disk. For trainers that choose what to keep themselves (Lightning's
        top-k by a metric): give such a Checkpointer a ``keep_last`` no run reaches."""
        step = step_number(step)  # ("3" or 2.9 would match no copy in memory, and remove none there)
        self._check_open()
        self._refuse_in_on_commit(f"remove({step})", step)
        with self._lock:
            pending = [snap for snap in self._inflight if snap.step == step]
        for snap in pending:
            snap.finished.wait()
        with self._lock:
            copying = step in self._copying_further
        if copying:  # the copy would put the step back there
            self._further_copier.drain()
        self.memory.discard(step)
        if self._recovery is not None:
            self._recovery.remove(step)
        if self.rank == 0:
            for level in (self.persistent, self.further):
                if level is not None:
                    level.remove_step(step)

    def wait_staged(self) -> None:
        """Block until every snapshot in flight is in host memory (for loops without an optimizer
        step, or before changing tensors in place outside the optimizer)."""
        self._check_open()
        self._refuse_in_on_commit("wait_staged()")  # (the next copy may wait for the committing snapshot's memory)
        with self._lock:
            inflight = list(self._inflight)
        for snap in inflight:
            if not snap.copied.done():
                start = now()
                snap.copied.wait()
                self.events.add("wait-staged", snap.step, start, now())
            snap.release()
        for snap in self.memory.snapshots():
            snap.release()
        self._raise_pending()

    def guard(self, obj, method: str = "step") -> None:
        """From now on ``obj.<method>(...)`` first waits until every snapshot in flight is staged.

        For code that changes saved tensors in place outside a torch optimizer's step, which
        nothing else holds back: an EMA's ``update``, a custom optimizer's ``step``, a module
        whose ``forward`` writes buffers through ``.data`` (a write the version check cannot
        see). Optimizer-like wrappers in the state (a ``step`` and ``param_groups``) are guarded
        by ``save`` already. The method is replaced on the object's class, where calls on other
        objects pass through; raises :class:`CheckpointError` if it cannot be (the object has its
        own attribute of that name). Guarding twice is guarding once; ``close`` undoes it. For a
        plain function, call :meth:`wait_staged` at its start instead.

        A torch optimizer's ``step`` gets the pre-step hook that optimizers in the state get:
        its parameters and state are then copied lazily in every later snapshot, even of a state
        that holds only their tensors (a framework's state dict), and its step waits for them,
        not for the rest (a step that writes other saved tensors needs a pre-step hook of its
        own that calls :meth:`wait_staged`)."""
        self._check_open()
        self._guard.guard(obj, method)

    def load_latest(self, state: dict, *, cast: bool = False) -> int | None:
        """Restore the newest committed step into ``state`` from the fastest level holding it;
        return the step (None if no level holds one; a level that cannot be listed, with none
        found elsewhere, raises a CheckpointError rather than report none). ``loaded_from`` names
        the level used.
        ``cast`` is ``ss.load``'s: floating dtypes may differ from the stored ones.

        A copy that fails is skipped with a warning for the next one: the same step on a slower
        level, then, past a step whose every copy is damaged, older committed steps (see
        fallback.py for what counts as damage). A restart that cannot load its newest
        checkpoint should resume from the one before rather than not at all; the warning and
        the returned step say which it was, and retention spares the steps before the damaged
        ones until the run has saved them again."""
        self._check_open()
        self._refuse_in_on_commit("load_latest()")
        self._wait_all()
        self._raise_pending()
        started = now()
        self.loaded_from = None  # until this call restores a step: nothing is loaded if it finds none, or fails
        levels = [level for level in (self.persistent, self.further) if level is not None]
        try:
            restored = load_newest(state, cast, self._comm, self.memory, self._arena, levels, self._recovery,
                                   self.config)
        except StateMismatchError as exc:  # whose own advice names ss.load's strict=False
            raise exc.advised(LOAD_LATEST_ADVICE + (CAST_HINT if CAST_HINT in exc.advice else "")) from None
        if restored is None:
            return None
        step, self.loaded_from, nbytes = restored
        self.events.add("load", step, started, now(), nbytes, level=self.loaded_from)
        self.events.flush()
        log.info("statesnap: restored step %d from the %s level", step, self.loaded_from)
        return step

    def stats(self) -> dict:
        """Sums of the events so far: stall, background time, throughput, back-pressure, ..."""
        out = self.events.summary()
        with self._lock:
            out["in_flight"] = len(self._inflight)
            out.update(self._counts)
        newest = self.memory.newest()
        out["memory_step"] = newest.step if newest is not None else None
        out["loaded_from"] = self.loaded_from
        return out

    def close(self) -> None:
        """Wait for the work in flight, stop the background threads, and raise what failed. In a
        forked child, nothing: the work, the threads and the roots' claims are the parent's."""
        if self._closed or os.getpid() != self._pid:
            return
        self._refuse_in_on_commit("close()")
        with self._lock:
            self._closing = True  # a save() on another thread now raises instead of queueing behind the end
        try:
            self._wait_all()
            for snap in self.memory.snapshots():  # the last look (after this, no hook tells of a step)
                snap.release()
        finally:
            self._closed = True
            self._stager.close()
            self._flusher.close()
            if self._further_copier is not None:
                self._further_copier.close()
            if self._local_flusher is not None:
                self._local_flusher.close()
            self._guard.close()
            self.events.flush()
            self._roots.release()
            for group in (self._group, self._local_group, self._further_group):
                if group is not None:
                    destroy_group(group)
            # The host memory and the groups go back now, not once this object is collected: a
            # closed Checkpointer left in scope held on to up to host_memory_gb, and the Comms of
            # its stages, which hold its methods (a cycle only the cyclic collector frees), held
            # the groups' sockets and threads (many Checkpointers on several ranks ran out of
            # descriptors).
            self._arena = None
            for comm in self._side_comms:
                comm.release()
            self._group = self._local_group = self._further_group = None
        self._raise_pending()

    def _finish_at_exit(self) -> None:
        """The program ends with this Checkpointer open: wait for its checkpoints in flight, for
        at most ``commit_timeout_s`` (their threads would die with the interpreter, and with them
        the newest checkpoints, unnoticed), and log what failed: nothing is left to raise it to.
        Not ``close``: the program may have destroyed the process groups already."""
        if self._closed:
            return
        with self._lock:
            inflight = list(self._inflight)
        if inflight:
            log.warning("statesnap: the program is ending with checkpoints of steps %s in flight and %s not closed; "
                        "finishing them (close() the Checkpointer to wait for them yourself)",
                        [snap.step for snap in inflight], self.persistent.root)
        late = self._wait_all(self.config.commit_timeout_s)
        if late is not None:
            log.error("statesnap: step %d was not finished within commit_timeout_s (%g s) of the program's end; "
                      "it is lost", late.step, self.config.commit_timeout_s)
            return
        try:
            self._raise_pending()
        except CheckpointError:
            log.exception("statesnap: a checkpoint of %s failed; found as the program ended", self.persistent.root)
        try:  # a lease on an object store would keep the restart out until it expires
            self._roots.release()
        except Exception:  # noqa: BLE001 (the lease then runs out by itself)
            log.warning("statesnap: releasing %s at the program's end failed", self.persistent.root, exc_info=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----------------------------------------------------------------- roots

    def _reachable(self, level: StorageLevel, step: int) -> bool:
        """Whether ``step`` can go to ``level`` (claimed anew if it was unreachable)."""
        if not self._roots.reachable(level, step):
            return False
        if level is self.persistent:
            self._flusher.target.backend = level.backend  # the claim's (made anew after an outage)
        return True

    def _start_local_level(self) -> None:
        """Learn which node every rank is on, make the group the node-local level talks on, and
        note whether this rank is its node's leader (who clears what crashed saves left in the
        node's level, once the roots are claimed)."""
        cfg = self.config
        topology = Topology(self._comm.all_gather(cfg.node_id), self.rank)
        if cfg.peer_replicas and len(set(topology.nodes)) < 2:
            self.config = without_peer_replicas(cfg, self._comm)
        self._local_group, comm = self._side_comm(f"node-local checkpoints under {self.local.root}")
        self._recovery = LocalRecovery(self.local, comm, topology, cfg.durable)
        self._local_leader = topology.is_leader

    def _side_comm(self, what: str) -> tuple:
        """A group of the Checkpointer's ranks for one background stage alone (None on one rank)
        and the Comm over it: stages that talk on one group from different threads would mix up
        the order of their collectives."""
        cfg, group = self.config, None
        if self._comm.active and self._comm.world_size > 1:
            ranks = None if cfg.process_group is None else dist.get_process_group_ranks(cfg.process_group)
            group = timed_group(ranks, cfg.commit_timeout_s, what, self._comm.rank)
        comm = Comm(group or cfg.process_group, what, cfg.commit_timeout_s, dedicated=group is not None)
        self._side_comms.append(comm)
        return group, comm

    # ----------------------------------------------------------------- planning (training thread)

    def _snapshot(self, step: int, state: dict, optimizers: list, trust_guards: bool = False) -> Snapshot | None:
        """What ``save`` records. ``trust_guards``: methods are guarded, and the tensors no
        optimizer writes are taken to change only through them (see ``_copy_unguarded_now``)."""
        flat = self._state_cache.flatten(state)
        layout = self._state_cache.layout(flat, optimizers)
        metas = layout.metas
        objects, blobs = encode_objects(flat, self.config.allow_pickle)  # every object: memory restores all
        snapshot_bytes = layout.snapshot_bytes
        plan, elsewhere, owned = self._plan_for(metas, shared_names(flat), snapshot_bytes)
        arena = self._ensure_arena(snapshot_bytes, layout.on_cuda, step)
        fits = align_up(snapshot_bytes, REGION_ALIGN) <= arena.capacity
        resident = self._fits_everywhere(fits)
        persist = step % self.config.persist_every == 0 and self._reachable(self.persistent, step)
        local = self.local is not None and step % self.config.local_every == 0
        if not resident and not persist:
            if not self._warned_streaming:
                whose = "another rank's state does not fit its" if fits else "the state does not fit"
                warnings.warn(f"{whose} host_memory_gb (this rank's: {snapshot_bytes / 1e9:.2f} GB, "
                              f"host_memory_gb={self.config.host_memory_gb:g}): steps that are not persisted "
                              "cannot be kept in memory and are skipped", RuntimeWarning, stacklevel=3)
                self._warned_streaming = True
            return None
        owners = layout.owners
        copied_now = self._copy_unguarded_now(flat, layout)
        locals_ = [item.local for item in flat.tensors]
        versions = layout.versions(locals_)
        hot = frozenset() if copied_now else self._state_cache.changed_unguarded(layout, flat, versions)
        hot = frozenset() if trust_guards else hot
        cuda_ready = mark_devices(locals_) if layout.on_cuda else {}
        if cuda_ready and self._cuda is None:
            self._cuda = CudaCopier()
        return Snapshot(
            step=step, flat=flat, metas=metas, plan=plan, elsewhere=elsewhere, owned=owned, persist=persist,
            resident=resident, versions=versions, storages=layout.storages(locals_), owners=owners,
            writers=layout.writers, owner_keys=layout.owner_keys, hot=hot, late_checks=layout.late_checks,
            resolved=layout.resolved,
            plain=layout.plain, nbytes=layout.nbytes,
            objects=objects, blobs=blobs, per_rank=per_rank_names(flat), cuda_ready=cuda_ready,
            object_digests=object_digests(flat, objects) if (persist or local) and self._compares_objects else {},
            rank=self.rank, path=self.persistent.path(step), local=local)

    def _fits_everywhere(self, fits: bool) -> bool:
        """Whether every rank's snapshot fits its arena (``fits``: this rank's). Where one does not,
        the steps that are not persisted are skipped by every rank together: a rank skipping alone
        put the node-local level's collectives out of step for good. Agreed when the layout
        changes, when the ranks plan together (``_plan_for``); a layout keeps its size and arena."""
        if self._fits_key is not self._plan_key:
            self._all_fit = all(self._comm.all_gather(fits)) if self._comm.world_size > 1 else fits
            self._fits_key = self._plan_key
        return self._all_fit and fits

    def _copy_unguarded_now(self, flat, layout) -> bool:
        """No optimizer hook holds back a change to a tensor no optimizer writes, and some change
        right away (a BatchNorm's running statistics, in the very next forward). Copy those here,
        on the training thread and, on a GPU, its stream, so the background stages the copies;
        the version check alone could miss a change still under way when it looks. Larger sets
        stay lazy, and ``save`` waits for the copies of those that changed since the last save
        (``StateCache.changed_unguarded``), unless methods are guarded: a user who guards the writer
        of such tensors (an EMA's update), or a wrapper whose guarded step writes the weights,
        has said what changes them. Whether they were copied here."""
        if not layout.unguarded or layout.unguarded_bytes > self.config.eager_copy_bytes:
            return False
        for index in layout.unguarded:  # new items: later saves reuse the unchanged ones
            item = flat.tensors[index]
            flat.tensors[index] = dataclasses.replace(item, local=item.local.detach().clone())
        return True

    def _plan_for(self, metas: list, objects: list, snapshot_bytes: int) -> tuple:
        """The save plan (``engine.save.plan_by_owners``: no rank plans more than about its own
        items' share), reused while this rank's layout is unchanged. Ranks change layout together:
        a new layout is planned by two all-to-alls on the trainer's group, here on its thread, and
        its checksum block size agreed on (``_agree_on_blocks``)."""
        key = (tuple(metas), tuple(objects))
        if key != self._plan_key:
            try:
                self._plan = plan_by_owners(self._comm, metas, objects)
                self._agree_on_blocks(snapshot_bytes, max((meta.nbytes for meta in metas), default=0))
            except PeerLostError as exc:
                raise CheckpointError(
                    f"{exc}. This rank's state changed layout since its last save (or this is its first save) and "
                    "it waited for the other ranks to plan the new one with it; they did not come within "
                    "commit_timeout_s: they are that late to this save (raise commit_timeout_s), or their layout "
                    "did not change at this save. Every rank must change layout at the same save: an optimizer "
                    "other than torch's Adam/AdamW (whose state save() creates ahead; not their subclasses) "
                    "creates a parameter's state at its first gradient, so a parameter some ranks leave without "
                    "one (an expert no token reached, an unused branch) changes those ranks' layout at a later "
                    "save. Give every parameter its optimizer state before the first save (a step in which each "
                    "gets a gradient), or save such states with ss.save") from exc
            self._plan_key = key
        return self._plan

    def _arena_bytes(self, snapshot_bytes: int) -> int:
        """The arena a layout wants: room for two snapshots (one written while the next is
        copied) within the budget."""
        reserved = self.config.max_in_flight * self.config.eager_copy_bytes  # see _copy_unguarded_now
        if self.config.peer_replicas:  # the replica receiver's bounce buffer (local.py)
            reserved += peer_buffer_bytes(self.config.host_memory_bytes)
        limit = (self.config.host_memory_bytes - reserved) // REGION_ALIGN * REGION_ALIGN
        return max(min(limit, 2 * align_up(snapshot_bytes, REGION_ALIGN)), REGION_ALIGN)

    def _agree_on_blocks(self, snapshot_bytes: int, largest: int) -> None:
        """Every rank checksums in blocks of one size: the manifest records one size for all. Each
        rank chose its own from its arena, sized by its own state, and the checkpoint of uneven
        states committed and failed every read ('the wrong number of checksums'). The size is
        the smallest any rank needs: a rank copying an item (of ``largest`` bytes at most) in
        several segments needs blocks no larger than its segment, which its arena bounds; a rank
        whose items each fit one segment needs none smaller than the setting (one holding little
        made every rank's blocks a page). A change waits for the checkpoints in flight."""
        segment = segment_of(self._arena_bytes(snapshot_bytes))
        own = self.config.block_bytes if largest <= segment else min(self.config.block_bytes, segment)
        agreed = min(self._comm.all_gather(own)) if self._comm.world_size > 1 else own
        if agreed != self._block_bytes:
            self._wait_all()
            self._block_bytes = agreed

    def _ensure_arena(self, snapshot_bytes: int, pin: bool, step: int) -> Arena:
        """Allocate the arena once. Only a layout that outgrows it makes a new one, after the work
        in flight. Its segments are whole checksum blocks (of the size the ranks agreed on). One
        made while ``close()`` runs on another thread is dropped, not kept by the closed object."""
        want = self._arena_bytes(snapshot_bytes)
        arena = self._arena
        if arena is None or arena.capacity < want:
            if arena is not None:
                self._wait_all()
                arena.evict_all()
                self.memory.clear()
            arena = Arena(want, pin and torch.cuda.is_available())
            with self._lock:
                if self._closing:
                    raise CheckpointError(f"this Checkpointer was closed while step {step} was being saved; the "
                                          "step was not saved")
                self._arena = arena
        segment = segment_of(arena.capacity)
        # whole blocks; a segment smaller than a block holds every item whole (_agree_on_blocks)
        self._segment_bytes = segment // self._block_bytes * self._block_bytes or segment
        return arena

    # ----------------------------------------------------------------- bookkeeping

    def _wait_for_slot(self, step: int) -> None:
        """Back-pressure: at most ``max_in_flight`` checkpoints staged or flushing at once."""
        while True:
            with self._lock:
                if len(self._inflight) < self.config.max_in_flight:
                    return
                oldest = self._inflight[0]
            start = now()
            oldest.finished.wait()
            self.events.add("backpressure", step, start, now())

    def _wait_all(self, timeout: float | None = None) -> Snapshot | None:
        """Wait for every snapshot in flight; return the first not finished within ``timeout``."""
        deadline = None if timeout is None else now() + timeout
        with self._lock:
            inflight = list(self._inflight)
        for snap in inflight:
            if not snap.finished.wait(None if deadline is None else max(0.0, deadline - now())):
                return snap
        return None

    def _release_inflight(self, optimizer_id: int | None) -> None:
        """A writer waited and is about to change tensors: an optimizer's step (its own items),
        or a guarded method or ``wait_staged`` (None: every item). The snapshots kept in host
        memory only are looked at too: no commit did, and a restore from memory trusts them."""
        with self._lock:
            inflight = list(self._inflight)
        for snap in inflight + self.memory.snapshots():
            snap.release(None if optimizer_id is None else snap.owner_of(optimizer_id))

    def _gates_for(self, optimizer_id: int | None) -> list:
        """What a writer waits for: an optimizer's copies, or (None) every snapshot's whole copy."""
        with self._lock:
            if optimizer_id is None:
                return [(s.step, s.copied) for s in self._inflight if s.copied is not None]
            return [(s.step, s.gates[s.owner_of(optimizer_id)]) for s in self._inflight
                    if s.owner_of(optimizer_id) in s.gates]

    def _copying(self, storages: set[int]) -> bool:
        """Whether a snapshot in flight still copies a tensor that lies in one of ``storages``.
        A step in ``on_commit`` does not wait (the copy may wait for the memory of the snapshot
        committing: a hang): the snapshots it would write under are dropped instead, since a fused
        step moves no version counter that a check could find."""
        with self._lock:
            pending = [snap for snap in self._inflight if snap.copied is not None and not snap.copied.done()]
        under = [snap for snap in pending if not snap.storage_bases().isdisjoint(storages)]
        if under and getattr(self._in_on_commit, "step", None) is not None:
            for snap in under:
                snap.fail(ConsistencyError(f"checkpoint of step {snap.step}: an optimizer stepped in on_commit "
                                           "changed its tensors before their copy was done, so it was dropped; "
                                           "step optimizers in the training loop, not in on_commit"))
            return False
        return bool(under)

    def _copies_done(self, snap: Snapshot) -> None:
        if not snap.persist and not snap.local:
            self._finish(snap)

    def _local_done(self, snap: Snapshot, error: BaseException | None) -> None:
        if error is not None:
            self._record_failure(None, as_checkpoint_error(error, snap.step, self.local.path(snap.step)))
        if snap.stage_ended():
            self._finish(snap)

    def _flushed(self, snap: Snapshot, committed: int | None) -> None:
        try:
            if committed is not None:
                self._count("committed")
                try:
                    self._after_commit(snap.step)
                finally:
                    snap.committed = True
                    self._report_commit(snap.step)
        finally:
            if snap.stage_ended():  # the node-local flush may still read the arena
                self._finish(snap)  # whatever happens after the commit, nobody waits for this forever

    def _report_commit(self, step: int) -> None:
        """One INFO line per commit (rank 0) and the user's ``on_commit``, whose failure is logged:
        a metrics hook must never cost a checkpoint."""
        record = self.events.commit_record(step, self.persistent.path(step))
        if self.rank == 0:
            log.info("statesnap: committed step %d to %s: %d bytes, stall %.4f s, written in %.3f s (%.2f GB/s)",
                     step, record.path, record.bytes, record.stall_s, record.write_s, record.throughput_gbps)
        if self.config.on_commit is not None:
            self._in_on_commit.step = step
            try:
                self.config.on_commit(record)
            except Exception:  # noqa: BLE001 (logged; the checkpoint is committed)
                log.exception("statesnap: on_commit raised for step %d; the checkpoint is committed", step)
            finally:
                self._in_on_commit.step = None

    def _after_commit(self, step: int) -> None:
        """Start the further-level copy (every rank copies its own files), then rank 0 applies
        retention on the persistent level."""
        further = self._further_copier is not None and step % self.config.further_every == 0
        with self._lock:
            self._last_committed = step
            if further:
                self._copying_further.add(step)
        if further:
            self._further_copier.submit(step)
        if self.rank == 0:
            self._retain_persistent(step)

    def _retain_persistent(self, newest: int | None) -> None:
        """Retention on the persistent level, sparing the last commit (not the highest step after a
        run went back) and the further copies."""
        with self._lock:
            protected = {newest, self._last_committed, *self._copying_further}
        try:
            self.persistent.retain(protected, newest)
        except CheckpointError as exc:  # the root was taken over: nothing is deleted
            self._record_failure(None, exc)
        except Exception as exc:  # noqa: BLE001 (surfaces at the next call)
            self._record_failure(None, CheckpointError(f"retention in {self.persistent.root} failed: {exc}"))

    def _further_done(self, step: int, error: CheckpointError | None) -> None:
        """A further copy ended, with the same outcome on every rank: what it kept alive on the
        persistent level may go now (rank 0 waited in its commit for every rank's files)."""
        if error is not None:
            self._record_failure(None, error)
        with self._lock:
            self._copying_further.discard(step)
        if self.rank == 0:
            self._retain_persistent(None)

    def _finish(self, snap: Snapshot) -> None:
        """The snapshot is done: keep it as the memory level (or free its space) and report."""
        if snap.region is not None:
            if snap.error is None and snap.resident:
                self.memory.add(snap)
                self._arena.hold(snap.region, lambda: self.memory.drop(snap))
            else:
                self._arena.release(snap.region)
        if snap.mark_durable(snap.path if snap.committed else None) and not snap.committed:
            self._count("memory_only")  # a step kept in memory (and maybe node-local storage) only
        if snap.error is not None:
            self._count("failed")
            self._record_failure(snap, snap.error)
        with self._lock:
            if snap in self._inflight:  # (not if a stage's failure abandoned it: _abandon)
                self._inflight.remove(snap)
        snap.finished.set()
        self.events.flush()

    def _abandon(self, snap: Snapshot) -> None:
        """A background stage failed past its own handling (a bug) before the snapshot was
        finished: report it at the next call and let nobody wait for it forever. Its arena space,
        in a state nobody knows, is not reused. (After it was finished, its outcome stands and the
        failure is only logged.)"""
        with self._lock:
            if snap not in self._inflight:
                return
            self._inflight.remove(snap)
        self._record_failure(snap, snap.error)
        snap.finished.set()

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def _record_failure(self, snap: Snapshot | None, error: BaseException) -> None:
        with self._lock:
            self._failed.append((snap, error))

    def _raise_pending(self) -> None:
        failure = self._take_failures()
        if failure is not None:
            self._report(failure)

    def _take_failures(self) -> CheckpointError | None:
        """The background failures not reported yet, as one error, which they then count as."""
        with self._lock:
            failing = [(s, s.error) for s in self._inflight if s.error is not None]  # known before it ends
            failed = [(s, e) for s, e in [*self._failed, *failing] if s is None or not s.was_reported()]
            self._failed.clear()
            for snap, _ in failed:
                if snap is not None:
                    snap.reported = True
        if not failed:
            return None
        error = failed[0][1]
        if len(failed) > 1:
            error = CheckpointError(f"{len(failed)} checkpoints failed in the background; the first: {error}")
            error.__cause__ = failed[0][1]
        return error

    def _report(self, failure: CheckpointError) -> None:
        if self.config.on_error == "raise":
            raise failure
        warnings.warn(str(failure), RuntimeWarning, stacklevel=4)

    def _refuse_in_on_commit(self, what: str, step: int | None = None) -> None:
        """``on_commit`` runs on the thread committing a step: a call that waits for that commit
        (any save, restore or close; removing that step) would wait forever."""
        committing = getattr(self._in_on_commit, "step", None)
        if committing is not None and (step is None or step == committing):
            raise CheckpointError(f"{what} was called from on_commit, which runs on the thread committing step "
                                  f"{committing}: it would wait for that commit; call it from the training loop")

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")
        if os.getpid() != self._pid:  # its work would wait forever for threads the child lacks
            raise CheckpointError(f"this Checkpointer belongs to process {self._pid}; a forked child (pid "
                                  f"{os.getpid()}) cannot use it: make one in the child")
