"""PyTorch Lightning: statesnap as the Trainer's ``CheckpointIO``, in one line.

    trainer = Trainer(plugins=[StatesnapCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path="last")

Lightning names every checkpoint by a path it chooses (``epoch=1-step=400.ckpt``, ``last.ckpt``)
and decides itself which to keep (top-k by a metric) and when to delete. statesnap keeps the
checkpoints in a store beside them, ``<dirpath>/statesnap/step-N``, written by one
:class:`statesnap.Checkpointer` per directory: ``save_checkpoint`` returns once the snapshot is
planned, the tensors (the live parameters and optimizer state Lightning hands over, not copies)
are copied while the next forward and backward run, and the optimizer's update waits for that
copy (its step runs the forward and backward inside its closure, which keeps them overlapped).
The path Lightning named becomes a small pointer file, written once the checkpoint is
committed: a crash at any moment leaves every ``last`` pointer naming a whole checkpoint, so
``ckpt_path="last"`` resumes from the newest one committed. (Other new names are taken when
their save begins: ``_Store._reserve``.) ``remove_checkpoint`` deletes the
pointer and, once no pointer names it, the checkpoint; while a save is in flight, only once that
save has committed (with ``save_top_k=1`` Lightning removes the one good checkpoint right after
starting the save of its successor). A save whose tensors did not change since
the previous one (``last.ckpt`` after the top-k file of the same step) shares its stored step:
only its own non-tensor state goes into its pointer.

What Lightning puts in its checkpoint besides tensors (loops, callbacks, hyper-parameters,
schedulers) is stored as data, not pickle (``integrations/skeleton.py``); an object that is not
plain data is refused by name unless ``allow_pickle=True``.

Under DDP Lightning calls ``save_checkpoint`` on rank 0 alone; the Checkpointer then works on a
group of that one rank, and every rank loads. Under ``ModelParallelStrategy`` Lightning writes
DCP checkpoints itself and never calls a ``CheckpointIO``: use
:class:`StatesnapModelParallelStrategy`, whose saves go through statesnap on every rank.
"""
from __future__ import annotations

import functools
import inspect
import io
import itertools
import logging
import os
import re
import sys
import threading
import weakref
from concurrent import futures
from typing import Any

import fsspec
import fsspec.implementations.local
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..checkpointer import Checkpointer
from ..checkpointer.at_exit import finish_at_exit
from ..checkpointer.config import CheckpointerConfig
from ..checkpointer.hooks import version_of
from ..convert.torch_save import is_torch_save_bytes
from ..engine.load import load
from ..errors import CheckpointError, described
from ..reader import open as open_checkpoint
from ..state.placement import is_dtensor
from ..state.wrappers import Replicated
from ..storage import is_url, normalize
from . import skeleton
from .pointers import POINTER_MAX_BYTES, PointerFailures, parse_pointer, pointer_bytes, step_of, write_atomically

try:
    from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError:  # the older package name
    from pytorch_lightning.plugins.io import CheckpointIO, TorchCheckpointIO
    from pytorch_lightning.strategies import ModelParallelStrategy

POINTER_FORMAT = "statesnap-lightning-1"
STORE_DIR = "statesnap"
KEEP_ALL = 1 << 30  # Lightning chooses what to delete, through remove_checkpoint
_SHARDED = ("state_dict.", "optimizer_states.")  # the rest of the checkpoint is one rank's
_TEMPORARY = re.compile(r"\.tmp-[0-9a-f]{8}$")
# what ckpt_path="last" chooses among: ModelCheckpoint's last checkpoints (CHECKPOINT_NAME_LAST)
# and OnExceptionCheckpoint's file, by their default names
_LAST = re.compile(r"^(last|on_exception)")
_FIXED = ("keep_last", "persist_every", "on_commit", "process_group")
_OWN_STATE_MAX = 256 << 10  # a pointer carries at most this much of a checkpoint's own state
log = logging.getLogger("statesnap")
# path -> the handle of a save to it still in flight, for every plugin of the process: a load
# right after ``trainer.save_checkpoint`` (by a new Trainer, or ``load_from_checkpoint``) waits
# for the pointer instead of finding no file
_IN_FLIGHT: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class StatesnapCheckpointIO(CheckpointIO):
    """``CheckpointIO`` that saves through :class:`statesnap.Checkpointer`.

    ``checkpointer_settings`` go to each directory's Checkpointer (``host_memory_gb``,
    ``durable``, ``threads``, ``further_root``, ...), except those this plugin sets:
    ``keep_last`` (Lightning deletes), ``persist_every`` (each save persists), ``on_commit`` and
    ``process_group``. ``allow_pickle``: store objects that are not plain data by pickling them.
    """

    def __init__(self, *, allow_pickle: bool = False, storage_options: dict | None = None, **checkpointer_settings):
        fixed = sorted(set(checkpointer_settings) & set(_FIXED))
        if fixed:
            raise CheckpointError(f"StatesnapCheckpointIO sets {', '.join(fixed)} itself")
        CheckpointerConfig.check_names(checkpointer_settings)  # now, not at the first save an epoch later
        self.allow_pickle = allow_pickle
        self.storage_options = storage_options
        self.collective = False  # True: every rank saves (StatesnapModelParallelStrategy)
        self._settings = checkpointer_settings
        self._stores: dict[str, _Store] = {}
        self._optimizers: weakref.WeakSet = weakref.WeakSet()
        self._hook = None
        self._steps = [0]  # optimizer steps taken (all optimizers): saves with steps between never link
        self._watch_optimizers()  # made before training: it sees the first step too
        _hold_back_parameter_writers()
        _LIVE.add(self)
        finish_at_exit(self, StatesnapCheckpointIO._finish_at_exit)

    # ----------------------------------------------------------------- CheckpointIO

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("StatesnapCheckpointIO takes storage options when it is made, not per save")
        self._watch_optimizers()
        path = _normal(path)
        store = self._store_for(path)
        for optimizer in list(self._optimizers):
            store.ckpt.guard(optimizer)  # its tensors are copied lazily; its update waits
        store.save(checkpoint, path, self.allow_pickle, self._steps[0])

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        path = _normal(path)
        _wait_in_flight(path)
        for store in self._stores.values():
            store.raise_failures()
        pointer = _read_pointer(path, self.storage_options)
        if pointer is None:  # a checkpoint Lightning wrote itself: read it the way Lightning does
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return read_checkpoint(pointer[0], self.allow_pickle, self.storage_options, own_state=pointer[1])

    def remove_checkpoint(self, path) -> None:
        path = _normal(path)
        self._store_for(path).remove(path)

    def teardown(self) -> None:
        """Finish every save in flight (their pointers are written when they commit)."""
        stores, self._stores = list(self._stores.values()), {}
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        errors = []
        for store in stores:
            try:
                store.close()
            except CheckpointError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def _finish_at_exit(self) -> None:
        """Lightning tears the plugin down when ``fit`` ends; a ``trainer.save_checkpoint`` after
        that has no teardown to come. Its Checkpointer finishes it as the program ends (made
        later, so finished first); this then reports the pointers that could not be written,
        in the log, as nothing is left to raise them to."""
        if not self._stores:
            return
        try:
            self.teardown()
        except CheckpointError:
            log.exception("statesnap: a Lightning checkpoint still in flight when the program ended failed")

    def wait_staged(self) -> None:
        """Wait until every checkpoint in flight is copied: the model's tensors may then change."""
        for store in list(self._stores.values()):
            store.ckpt.wait_staged()

    # ----------------------------------------------------------------- helpers

    def _watch_optimizers(self) -> None:
        """Learn the optimizers as they step (Lightning's dict holds only their state): from the
        next save on, the Checkpointer hooks them."""
        if self._hook is None:
            seen, steps = self._optimizers, self._steps

            def learn(optimizer, args, kwargs):
                seen.add(optimizer)
                steps[0] += 1
            self._hook = register_optimizer_step_pre_hook(learn)

    def _store_for(self, path: str) -> _Store:
        directory = os.path.dirname(path.rstrip("/")) or "."
        store = self._stores.get(directory)
        if store is None:
            store = self._stores[directory] = _Store(directory, self._settings, self.collective,
                                                     self.storage_options)
        return store


_LIVE: weakref.WeakSet = weakref.WeakSet()  # the plugins made, while they live

# Lightning's own callbacks that write the model's parameters in place outside an optimizer's
# step, where a checkpoint's lazy copy may still be reading them: StochasticWeightAveraging
# copies the averaged weights into the model when averaging ends (its checkpoints failed with a
# ConsistencyError: changed in place after save()). (module under either package name, class,
# static method)
_PARAMETER_WRITERS = (("callbacks.stochastic_weight_avg", "StochasticWeightAveraging", "transfer_weights"),)


def _hold_back_parameter_writers() -> None:
    """Make each of ``_PARAMETER_WRITERS`` first wait until the checkpoints of every live plugin
    are copied, as an optimizer's step does (``ckpt.guard`` cannot: they are static methods).
    Only in the Lightning packages already imported (importing Lightning imports its callbacks)."""
    for (module_name, class_name, name), package in itertools.product(
            _PARAMETER_WRITERS, ("lightning.pytorch", "pytorch_lightning")):
        cls = getattr(sys.modules.get(f"{package}.{module_name}"), class_name, None)
        original = vars(cls).get(name) if cls is not None else None
        if not isinstance(original, staticmethod) or getattr(original.__func__, "_statesnap_waits", False):
            continue

        @functools.wraps(original.__func__)
        def waiting(*args, _write=original.__func__, **kwargs):
            for plugin in list(_LIVE):
                plugin.wait_staged()
            return _write(*args, **kwargs)
        waiting._statesnap_waits = True
        setattr(cls, name, staticmethod(waiting))


class StatesnapModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 / tensor parallel) whose checkpoints go through statesnap.

    Lightning's strategy writes DCP checkpoints itself, bypassing any ``CheckpointIO``. Here every
    rank saves its shards of the model's and optimizers' DTensors through one collective
    Checkpointer (``checkpoint_io``'s settings), stored with their global shapes; a resume loads
    them in place, resharded into the current mesh (another data- or tensor-parallel size, or a
    single process), then hands them to PyTorch's ``set_model_state_dict`` /
    ``set_optimizer_state_dict``. Needs ``save_distributed_checkpoint=True`` (the default)."""

    def __init__(self, *args, checkpoint_io: StatesnapCheckpointIO | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if not self._save_distributed_checkpoint:
            raise CheckpointError("StatesnapModelParallelStrategy saves sharded checkpoints: keep "
                                  "save_distributed_checkpoint=True")
        self._statesnap = checkpoint_io or StatesnapCheckpointIO()
        self._statesnap.collective = True

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        self._statesnap.save_checkpoint(checkpoint, self.broadcast(str(filepath)), storage_options)

    def remove_checkpoint(self, filepath) -> None:
        self._statesnap.remove_checkpoint(self.broadcast(str(filepath)))  # every rank keeps its books

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict,
        )
        path = _normal(self.broadcast(str(checkpoint_path)))
        _wait_in_flight(path)
        for store in self._statesnap._stores.values():
            store.raise_failures()
        pointer = _read_pointer(path, self._statesnap.storage_options)
        if pointer is None:
            raise CheckpointError(f"{path} is not a statesnap checkpoint of a Lightning run")
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        by_name = [self.optimizer_state(o) for o in optimizers]
        # Each state tensor under both keys: a DDP run's checkpoint keys them by position
        live = {"state_dict": self.lightning_module_state_dict(),
                "optimizer_states": [{"state": {**state["state"], **_keyed_by_position(state)}} for state in by_name]}
        checkpoint = read_checkpoint(pointer[0], self._statesnap.allow_pickle, self._statesnap.storage_options,
                                     into=live, own_state=pointer[1])
        checkpoint["optimizer_states"] = [_keyed_by_name(stored, live_state, path)
                                          for stored, live_state in zip(checkpoint["optimizer_states"], by_name)]
        # A parameter that never had a gradient has no optimizer state in the checkpoint either
        options = StateDictOptions(full_state_dict=False, cpu_offload=True, strict=False)
        strict = self.lightning_module.strict_loading
        set_model_state_dict(self.model, checkpoint["state_dict"], options=StateDictOptions(
            full_state_dict=False, cpu_offload=True, strict=strict))
        for optimizer, state in zip(optimizers, checkpoint["optimizer_states"]):
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state, options=options)
        return checkpoint

    def teardown(self) -> None:
        try:
            self._statesnap.teardown()
        finally:
            super().teardown()


class _Store:
    """The Checkpointer of one directory, the pointers in it, and which step each names."""

    def __init__(self, directory: str, settings: dict, collective: bool, storage_options: dict | None):
        self.directory = directory
        self.collective = collective
        self.fs, _ = fsspec.core.url_to_fs(directory, **(storage_options or {}))
        group = None
        if not collective and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Lightning saves from global rank 0 alone: a group of that rank, made by it alone
            group = dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
        self.ckpt = Checkpointer(_join(directory, STORE_DIR), keep_last=KEEP_ALL, persist_every=1,
                                 process_group=group, on_commit=self._committed, storage_options=storage_options,
                                 **settings)
        self.rank = self.ckpt.rank
        self._lock = threading.Lock()
        self._named: dict[str, int] = {}  # pointer path -> step
        self._waiting: dict[int, list[tuple]] = {}  # step in flight -> [(path, own state)] to point at it
        self._handles: dict[str, Any] = {}  # path -> its newest save's handle, until it is known to have committed
        # (step whose commit it waits for, pointer path, the step it named) of each removal
        # asked for while saves were in flight
        self._deferred: list[tuple[int, str, int]] = []
        self._failures = PointerFailures()
        self._previous: tuple | None = None  # (fingerprint, step, handle, skeleton, tensors) of the newest save
        self._storage_options = storage_options
        damaged = []
        for name in self._listdir(directory):
            if _TEMPORARY.search(name) and self.rank == 0:  # a pointer whose write a crash cut short
                self.fs.rm(name)
                continue
            # A pointer whose own state is damaged still names its step: kept, refused when loaded
            try:
                pointer = _read_pointer(name, storage_options, verify=False)
            except CheckpointError:
                pointer = None
            step = None if pointer is None else step_of(pointer[0])
            if step is not None:
                self._named[name] = step
            elif self._looks_like_a_pointer(name):
                damaged.append(name)
        stored = [step_of(n) for n in self._listdir(_join(directory, STORE_DIR))]
        stored = [s for s in stored if s is not None]
        # past every step a pointer names too: a pointer whose step was deleted must not come to
        # name another checkpoint when a later run saves a step of that number again
        self._next_step = max([*stored, *self._named.values()], default=0) + 1
        unnamed = sorted(set(stored) - set(self._named.values()))  # committed, but its pointer never written
        if damaged and unnamed:
            # one of them may be what a damaged pointer named: deleting it could lose a checkpoint
            log.warning("%s: kept steps %s, which no readable pointer names, because %s cannot be read as "
                        "pointers", directory, unnamed, ", ".join(damaged))
            unnamed = []
        for step in unnamed:
            self.ckpt.remove(step)

    def save(self, checkpoint: dict, path: str, allow_pickle: bool, optimizer_steps: int) -> None:
        structure, tensors = skeleton.split(checkpoint, allow_pickle)
        fingerprint = _fingerprint(checkpoint, tensors, optimizer_steps)
        if self._link(path, fingerprint, structure):
            return
        # Besides the model and the optimizers, ranks may hold different values (an unsynced
        # logged metric in a callback's state): as Lightning does, one rank's copy is kept.
        tensors = {name: t if name.startswith(_SHARDED) else Replicated(t) for name, t in tensors.items()}
        step, self._next_step = self._next_step, self._next_step + 1
        with self._lock:
            self._waiting[step] = [(path, None)]
        try:
            handle = self.ckpt.save(step, {"lightning": Replicated({"format": POINTER_FORMAT, "skeleton": structure}),
                                           "tensors": tensors})
        except BaseException:
            with self._lock:
                self._waiting.pop(step, None)
            raise
        self._track(path, handle)
        self._reserve(path, step)
        handle.durable.add_done_callback(lambda done: done.exception() is not None and self._failed(step))
        # The tensors are kept referenced so that no new tensor can take their addresses, which
        # the next save's fingerprint compares.
        self._previous = (fingerprint, step, handle, structure, tensors)

    def _link(self, path: str, fingerprint: tuple, structure: str) -> bool:
        """Point ``path`` at the newest save's tensors instead of saving them again when none
        changed since: ModelCheckpoint saves ``last.ckpt`` right after the top-k file of the same
        step, and a second copy and write of the same bytes would double what the step waits
        for. What differs (the callbacks' state) goes into the pointer itself, so each path still
        loads exactly what Lightning handed over. Every rank of a collective store must agree, or
        their saves would no longer match."""
        previous = self._previous
        same = (previous is not None and fingerprint is not None and previous[0] == fingerprint
                and len(structure) <= _OWN_STATE_MAX
                and self._usable(previous[1], previous[2]))
        if self.collective:
            same = all(self.ckpt._comm.all_gather(same))
        if not same:
            return False
        _, step, handle, stored, _ = previous
        own_state = None if structure == stored else structure
        with self._lock:
            waiting = self._waiting.get(step)
            if waiting is not None:
                waiting.append((path, own_state))  # pointed at once it commits
        if waiting is None:
            self._point(path, step, own_state)
        else:
            self._reserve(path, step, own_state)
            if handle.durable.done() and handle.durable.exception() is not None:
                self._unreserve(path, step)  # (it failed meanwhile: _failed may have looked before the write)
        self._track(path, handle)
        return True

    def _reserve(self, path: str, step: int, own_state: str | None = None) -> None:
        """Write now, where ``path`` is new, the pointer the commit of ``step`` writes there (not
        durably: the commit does). Lightning picks each name by whether a file is there
        (``epoch=0.ckpt``, then ``epoch=0-v1.ckpt``), and a name whose save was still in flight
        looked free: the next save took it, and its commit replaced the first (five of eight
        checkpoints lost, top-k scores kept for steps no file held). Until the commit it names a
        step not yet stored, which a load waits for, or, after a crash, says never completed. A
        path that exists names what it named until the commit (it is never written over), and a
        ``last`` or ``on_exception`` one is never taken early: ``ckpt_path="last"`` picks the
        newest of those, and a run killed while saving one must resume from the one before, as
        Lightning's own (atomic) saves leave it. (Under names of one's own for these, set with
        ``CHECKPOINT_NAME_LAST`` or ``OnExceptionCheckpoint(filename=...)``, such a run finds
        the pointer of the save it was killed in, which says so: delete it to resume.) One that
        cannot be written is logged: the commit's own write of it reports what stands in its way."""
        if _LAST.match(os.path.basename(path)):
            return
        try:
            if self.rank == 0 and not self.fs.exists(path):
                write_atomically(self.fs, path, pointer_bytes(POINTER_FORMAT, f"{STORE_DIR}/step-{step}", own_state),
                                 durable=False, exclusive=True)
        except OSError as exc:
            log.warning("statesnap: %s could not be taken for the save of step %d before it commits: %s", path, step,
                        described(exc))

    def _failed(self, step: int) -> None:
        """A save that failed is in flight no more: nothing waits for its commit (a removal
        deferred behind it waits for the next commit), and the new paths reserved for it go."""
        with self._lock:
            reserved = [path for path, _ in self._waiting.pop(step, []) if path not in self._named]
        for path in reserved:
            self._unreserve(path, step)

    def _unreserve(self, path: str, step: int) -> None:
        """Remove ``path`` if it is still the pointer ``_reserve`` wrote for ``step``, whose save failed."""
        try:
            pointer = _read_pointer(path, self._storage_options, verify=False) if self.rank == 0 else None
            if pointer is not None and step_of(pointer[0]) == step:
                self.fs.rm(path)
        except FileNotFoundError:  # (a removal of the path got there first)
            pass
        except Exception as exc:  # noqa: BLE001 (raised on the training thread)
            self._failures.add(CheckpointError(f"{path}, reserved for step {step} whose save failed, could not "
                                               f"be removed: {described(exc)}"))

    def _track(self, path: str, handle) -> None:
        """Remember the newest save to ``path``; forget those that committed (a run that keeps
        every checkpoint would otherwise hold a handle, and its snapshot, per checkpoint)."""
        self._handles = {p: h for p, h in self._handles.items()
                         if not (h.durable.done() and h.durable.exception() is None)}
        self._handles[path] = _IN_FLIGHT[path] = handle

    def remove(self, path: str) -> None:
        handle = self._handles.pop(path, None)
        if handle is not None:  # a save that failed left nothing to remove; the Checkpointer raises its error
            futures.wait([handle.durable])
        with self._lock:
            step = self._named.get(path)
            newest = max(self._waiting, default=None)
            if step is not None and newest is not None:
                # a save in flight may be the one meant to replace it: should it never commit
                # (a crash, a full disk), this one is all there is
                self._deferred.append((newest, path, step))
                return
        self._drop(path, step)

    def _drop(self, path: str, step: int | None) -> None:
        """Delete the pointer ``path`` (which named ``step``), and the step once nothing names it."""
        with self._lock:
            if self._named.get(path) != step:
                return  # pointed at a newer step since, which dropped this one if nothing else named it
            self._named.pop(path, None)
            orphaned = step is not None and step not in self._named.values()
        if self.rank == 0 and self.fs.exists(path):
            try:
                self.fs.rm(path)
            except FileNotFoundError:  # (a failed save's reservation, removed meanwhile: _unreserve)
                pass
        if orphaned:
            self.ckpt.remove(step)

    def raise_failures(self) -> None:
        """Raise the first pointer that could not be written or removed, once."""
        self._failures.raise_first()

    def close(self) -> None:
        try:
            self.ckpt.close()
        finally:
            for after, path, step in self._deferred:
                log.warning("statesnap: kept %s (step %d), which Lightning removed: the save of step %d, meant "
                            "to come after it, never committed", path, step, after)
        self._failures.raise_first()

    def _usable(self, step: int, handle) -> bool:
        """The save of ``step`` has not failed, and is in flight or still named by a pointer."""
        if handle.durable.done() and handle.durable.exception() is not None:
            return False
        with self._lock:
            return step in self._waiting or step in self._named.values()

    def _committed(self, record) -> None:
        """On commit (the Checkpointer's flush thread): point the paths waiting for it at the step.
        A pointer that cannot be written does not keep the others from theirs; its failure is
        raised by the next load or ``close`` (the Checkpointer only logs what its
        ``on_commit`` raises)."""
        with self._lock:
            paths = self._waiting.pop(record.step, [])
            due = [(path, step) for after, path, step in self._deferred if after <= record.step]
            self._deferred = [entry for entry in self._deferred if entry[0] > record.step]
        for path, own_state in paths:
            try:
                self._point(path, record.step, own_state)
            except Exception as exc:  # noqa: BLE001 (raised on the training thread)
                self._failures.add(CheckpointError(f"{path} could not be pointed at step {record.step}: "
                                                   f"{described(exc)}"))
        for path, step in due:  # removals that waited for this commit
            try:
                self._drop(path, step)
            except Exception as exc:  # noqa: BLE001 (raised on the training thread)
                self._failures.add(CheckpointError(f"{path} (step {step}) could not be removed after step "
                                                   f"{record.step} committed: {described(exc)}"))

    def _point(self, path: str, step: int, own_state: str | None = None) -> None:
        """Write the pointer ``path`` -> ``step`` (with the state that differs from the stored
        one's); drop the step it named before if no other path names that one."""
        with self._lock:
            before = self._named.get(path)
            self._named[path] = step
            orphaned = before is not None and before not in self._named.values()
        if self.rank == 0:
            write_atomically(self.fs, path, pointer_bytes(POINTER_FORMAT, f"{STORE_DIR}/step-{step}", own_state))
        if orphaned:
            self.ckpt.remove(before)

    def _looks_like_a_pointer(self, path: str) -> bool:
        """A small file that starts like JSON (Lightning's own checkpoints are zip files)."""
        try:
            return self.fs.isfile(path) and self.fs.size(path) <= POINTER_MAX_BYTES and \
                self.fs.cat_file(path, start=0, end=64).lstrip()[:1] == b"{"
        except OSError:
            return False

    def _listdir(self, directory: str) -> list[str]:
        try:
            names = self.fs.ls(directory, detail=False)
        except FileNotFoundError:
            return []
        if isinstance(self.fs, fsspec.implementations.local.LocalFileSystem):
            return [str(name) for name in names]
        return [self.fs.unstrip_protocol(name) for name in names]  # as Lightning names them: s3://...


def read_checkpoint(path: str, allow_pickle: bool = False, storage_options: dict | None = None,
                    into: dict | None = None, own_state: str | None = None) -> dict[str, Any]:
    """The Lightning checkpoint dict stored at statesnap checkpoint ``path``, verified as it is
    read, on the CPU (Lightning moves it to the module's devices as it restores). ``into``: a
    checkpoint-shaped dict whose tensors (DTensors: this rank's shards) receive the stored ones
    in place, resharded; the others are read whole. ``own_state``: a pointer's own structure,
    in place of the stored one."""
    try:
        reader = open_checkpoint(path, storage_options=storage_options, allow_pickle=allow_pickle)
    except CheckpointError:
        fs, _ = fsspec.core.url_to_fs(path, **(storage_options or {}))
        if fs.exists(path):
            raise
        raise CheckpointError(f"{path} is not there: the job stopped while saving it (a pointer is written when its "
                              "save begins), or it was deleted; resume from another checkpoint") from None
    if "lightning.skeleton" not in reader:
        raise CheckpointError(f"{path} is a statesnap checkpoint, but not one of a Lightning Trainer")
    given = skeleton.split(into)[1] if into is not None else {}
    tensors = {}
    for fqn in reader.keys():
        if fqn.startswith("tensors."):
            name = fqn[len("tensors."):]
            info = reader.info(fqn)
            tensors[name] = given.get(name)
            if tensors[name] is None:
                tensors[name] = torch.empty(info.shape, dtype=info.dtype)
    state = {"lightning": {"format": None, "skeleton": None}, "tensors": tensors}
    load(state, path, storage_options=storage_options, allow_pickle=allow_pickle)
    return skeleton.join(own_state or state["lightning"]["skeleton"], tensors, allow_pickle, where=path)


def load_from_checkpoint(cls, path, *, allow_pickle: bool = False, storage_options: dict | None = None, **kwargs):
    """``cls.load_from_checkpoint(path, **kwargs)`` (a ``LightningModule`` or ``LightningDataModule``
    class) for a checkpoint that :class:`StatesnapCheckpointIO` saved, such as
    ``ModelCheckpoint.best_model_path``.

    Lightning's classmethod reads the file with ``torch.load``, and the file Lightning named is a
    statesnap pointer, which ``torch.load`` cannot read. This reads the checkpoint it names
    (verified as it is read; objects that are not plain data only with ``allow_pickle``) and
    hands it to the classmethod as a stream, so hyper-parameters, ``map_location``, ``strict``
    and the module's ``on_load_checkpoint`` work as they do for Lightning's own files; a file
    Lightning wrote itself goes to the classmethod as it is. ``weights_only`` applies to such a
    file only: the stream holds what was read, and nothing more. While the model is built, the
    stream is one copy of the checkpoint in host memory more than Lightning's own load holds."""
    _wait_in_flight(_normal(path))
    pointer = _read_pointer(_normal(path), storage_options)
    if pointer is None:
        return cls.load_from_checkpoint(path, **kwargs)
    kwargs.pop("weights_only", None)
    stream = _as_stream(read_checkpoint(pointer[0], allow_pickle, storage_options, own_state=pointer[1]))
    if "weights_only" in inspect.signature(cls.load_from_checkpoint).parameters:  # Lightning 2.6 and later
        # (earlier ones hand what they do not know to the constructor)
        kwargs["weights_only"] = False  # the stream's objects are those just read
    return cls.load_from_checkpoint(stream, **kwargs)


def _as_stream(checkpoint: dict) -> io.BytesIO:
    """``checkpoint`` as ``torch.save`` writes it, in memory (the dict itself is let go)."""
    stream = io.BytesIO()
    torch.save(checkpoint, stream)
    stream.seek(0)
    return stream


def _parameter_names(optimizer_state: dict) -> list:
    """The parameters' keys of an optimizer state dict, in the order torch.optim numbers them."""
    return [key for group in optimizer_state["param_groups"] for key in group["params"]]


def _keyed_by_position(state: dict) -> dict:
    """The per-parameter state of ``get_optimizer_state_dict`` (keyed by parameter name) keyed
    by position instead, as ``torch.optim.Optimizer.state_dict`` keys it."""
    return {index: state["state"][name] for index, name in enumerate(_parameter_names(state)) if name in state["state"]}


def _keyed_by_name(stored: dict, live: dict, where: str) -> dict:
    """``stored`` keyed by parameter name as ``live`` is: a checkpoint of a DDP run numbers the
    parameters in their optimizer's order; the same ``configure_optimizers`` gives the same order."""
    positions, names = _parameter_names(stored), _parameter_names(live)
    if all(isinstance(key, str) for key in positions):
        return stored
    if len(positions) != len(names) or sorted(positions) != list(range(len(names))):
        raise CheckpointError(f"{where}: its optimizer state numbers {len(positions)} parameters, the optimizer "
                              f"being restored has {len(names)}; it was saved by another model or optimizer setup")
    return {"state": {names[index]: value for index, value in stored["state"].items()},
            "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                             for group in stored["param_groups"]]}


def _fingerprint(checkpoint: dict, tensors: dict[str, torch.Tensor], optimizer_steps: int) -> tuple | None:
    """What two saves share when nothing in them changed: the loop position, the optimizer steps
    taken and, for every tensor, its memory, layout and version counter (which an in-place change
    bumps). None (never the same) if a tensor has no version counter (an inference tensor).
    Not seen, as by the lazy copy's check (docs/checkpointer.md): writes through ``.data`` or
    through memory shared outside PyTorch between the two saves."""
    entries = []
    for name, tensor in tensors.items():
        version = version_of(tensor)
        if version is None:
            return None
        local = tensor.to_local() if is_dtensor(tensor) else tensor
        entries.append((name, local.data_ptr(), version, tuple(local.shape), local.stride(), local.dtype))
    return checkpoint.get("epoch"), checkpoint.get("global_step"), optimizer_steps, tuple(entries)


def _wait_in_flight(path: str) -> None:
    """Return once no save of this process to ``path`` is in flight. A failed one is the saving
    plugin's to raise (at its next save or teardown); the load reads what the file names."""
    handle = _IN_FLIGHT.get(path)
    if handle is not None:
        futures.wait([handle.durable])


def _normal(path) -> str:
    """Paths as the directory listings give them back: absolute, for local files (``file://``
    and ``shm://`` URLs included)."""
    path = normalize(path)
    return path if is_url(path) else os.path.abspath(path)


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}"


def _read_pointer(path: str, storage_options: dict | None, verify: bool = True) -> tuple[str, str | None] | None:
    """(the statesnap checkpoint a pointer file names, the pointer's own state), or None if
    ``path`` is no pointer. ``verify=False``: the own state is not checked against its checksum."""
    fs, _ = fsspec.core.url_to_fs(path, **(storage_options or {}))
    try:
        if not fs.isfile(path) or fs.size(path) > POINTER_MAX_BYTES:
            return None
        raw = fs.cat_file(path)
        pointer = parse_pointer(raw, POINTER_FORMAT, path, verify)
    except OSError:
        return None
    if pointer is None:
        if not is_torch_save_bytes(raw):  # neither a pointer nor what Lightning's own saves write
            raise CheckpointError(f"{path} is neither a statesnap pointer nor a Lightning checkpoint "
                                  f"({len(raw)} bytes): a damaged pointer; restore it, or resume from another checkpoint")
        return None
    return _join(os.path.dirname(path.rstrip("/")) or ".", pointer[0]), pointer[1]
