"""Where checkpoints live: host memory, the persistent level, and an optional further level.

Storage levels hold committed checkpoints as ``<root>/step-N`` directories in the normal
statesnap format, so ``ss.open``/``ss.load`` read them. Retention deletes the oldest committed
checkpoints beyond ``keep_last`` right after a newer one commits, so the newest committed
checkpoint is never deleted before the next one is in place. A checkpoint leaves the namespace in
one step before its bytes are deleted (``StorageBackend.retire``): a deletion cut short never
leaves a ``step-N`` that is not a whole checkpoint. Rank 0 claims each level's root for the
Checkpointer's life (``storage/lock.py``), so no other job's cleanup or retention runs there.

The memory level is the staging arena itself: a resident snapshot stays there after it is
written, until the ring needs its space, and restores into a state of the same layout without
touching storage.
"""
from __future__ import annotations

import logging
import threading
import uuid
import warnings
from typing import Callable, NamedTuple

import torch

from ..engine.load import mismatch_error, mismatches
from ..engine.objects import decode_value, fitted_to_held
from ..engine.overlaps import aliases_filled, overlapping_pairs, overwritten, same_view, tie_error
from ..engine.save import foreign_entries
from ..errors import CheckpointError
from ..format.dtypes import dtype_from_name, dtype_name
from ..format.manifest import MANIFEST_NAME
from ..state.flatten import StoredNames, flatten_for_load, plain_values, same_bits
from ..state.optim_state import restore_emptied
from ..storage.base import StorageBackend
from ..storage.local import RETIRED_MARK, LocalBackend
from ..storage.lock import ClaimedBackend, claim_root, held_root_above, held_root_within
from .staging import item_bytes_view

STEP_PREFIX = "step-"
log = logging.getLogger("statesnap")


def parse_step(name: str) -> int | None:
    """N for the name ``step-N`` as a Checkpointer writes it, else None. Only that spelling:
    ``step-0100`` or ``step-٥`` would parse to a step whose checkpoint is looked for elsewhere
    (``step-100``, ``step-5``), and the directory taken for a leftover of an interrupted save
    and deleted, a committed checkpoint in it or not."""
    digits = name[len(STEP_PREFIX):]
    if name.startswith(STEP_PREFIX) and digits.isascii() and digits.isdigit() and str(int(digits)) == digits:
        return int(digits)
    return None


class StorageLevel:
    def __init__(self, name: str, root: str, backend: StorageBackend, keep_last: int):
        self.name, self.root, self.backend, self.keep_last = name, root, backend, keep_last
        self.claim = None
        self._lease_token = uuid.uuid4().hex  # every claim of this level's root: see claim_root
        self.unreachable: str | None = None  # why the root could not be claimed, while it cannot
        # steps a restore found damaged here and went back past: retention neither counts them
        # (they would take the places of good ones) nor deletes them, until one is saved again
        self.damaged: set[int] = set()
        self._warned_newer: set[int] = set()  # steps past a rollback already warned about
        self._warned_holding: set[int] = set()  # steps kept for a live root inside, already warned about

    def claim_root(self, take_over: bool, lease_s: float) -> None:
        """Own the root for this job; from then on every commit and deletion checks the claim."""
        self._refuse_a_root_inside_a_held_step()
        self.claim = claim_root(self.root, self.backend, take_over, lease_s, self._lease_token)
        self.backend = ClaimedBackend(self.backend, self.claim)

    @property
    def _on_local_disk(self) -> bool:
        backend = self.backend._backend if isinstance(self.backend, ClaimedBackend) else self.backend
        return isinstance(backend, LocalBackend)

    def _refuse_a_root_inside_a_held_step(self) -> None:
        """A root inside a checkpoint (or a save in flight) of another live Checkpointer's root is
        deleted with it by that job's retention, this job's checkpoints and claim included."""
        above = held_root_above(self.root) if self._on_local_disk else None
        if above is not None and (parse_step(above[1]) is not None or above[1].startswith(f".{STEP_PREFIX}")):
            raise CheckpointError(
                f"{self.root} lies inside {above[1]} of {above[0]}, the root of a running Checkpointer, whose "
                "retention would delete it with this job's checkpoints: give this job a root outside that one's "
                "step directories")

    def release(self) -> None:
        if self.claim is not None:
            self.claim.release()
            self.backend, self.claim = self.backend._backend, None

    def path(self, step: int) -> str:
        return self.backend.join(self.root, f"{STEP_PREFIX}{step}")

    def is_committed(self, step: int) -> bool:
        return self.backend.exists(self.backend.join(self.path(step), MANIFEST_NAME))

    def committed_steps(self) -> list[int]:
        steps = (parse_step(name) for name in self.backend.listdir(self.root))
        return sorted(s for s in steps if s is not None and self.is_committed(s))

    def retain(self, protected: set[int], committed: int | None = None) -> list[int]:
        """Delete the oldest committed checkpoints beyond ``keep_last``; return their steps.
        ``committed``: the step just committed here, whole again if it was ``damaged``."""
        self.damaged.discard(committed)
        steps = [step for step in self.committed_steps() if step not in self.damaged]
        self._warn_of_newer(committed, steps)
        doomed = [s for s in steps[:-self.keep_last] if s not in protected and not self._holds_a_live_root(s)]
        for step in doomed:
            self.backend.retire(self.path(step), MANIFEST_NAME)
        return doomed

    def _holds_a_live_root(self, step: int) -> bool:
        """Whether ``step``'s directory holds the root of a running Checkpointer (one started
        there while this job was not running): it is kept, and the holder warned of, rather than
        deleted with that job's checkpoints and lock."""
        inner = held_root_within(self.path(step)) if self._on_local_disk else None
        if inner is not None and step not in self._warned_holding:
            self._warned_holding.add(step)
            message = (f"statesnap: step {step} at {self.root} is not deleted by retention: it holds {inner}, the root "
                       "of a running Checkpointer; give that job a root outside this one's step directories")
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return inner is not None

    def _warn_of_newer(self, committed: int | None, steps: list[int]) -> None:
        """Warn (once for each later step) of committed steps past the one just committed: a run that
        went back (restored an earlier step, or its step counter restarted) leaves the steps it
        abandoned, and ``load_latest`` restores the highest step, so a restart before this run
        passes them would go on from the abandoned run's state."""
        newer = [step for step in steps if step > committed] if committed is not None else []
        if set(newer) <= self._warned_newer:
            return
        self._warned_newer.update(newer)
        message = (f"statesnap: step {committed} was committed at {self.root}, which holds later steps "
                   f"{', '.join(map(str, newer))}: load_latest restores the highest step, so a restart before this run "
                   f"passes them would go on from step {newer[-1]}. If they belong to a run you went back from, "
                   "remove them (Checkpointer.remove(step))")
        log.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def remove_step(self, step: int) -> None:
        """Retire ``step`` here (``Checkpointer.remove``); an unreachable level is warned about,
        since a copy made there before the outage would still be restored."""
        if self.unreachable is not None:
            message = (f"statesnap: step {step} was not removed from the {self.name} level at {self.root}, which "
                       f"is unreachable ({self.unreachable}); a copy there made before the outage would still be "
                       "restored: remove it once the level is back")
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            return
        try:
            self.backend.retire(self.path(step), MANIFEST_NAME)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 (any storage library's error)
            raise CheckpointError(f"removing {self.path(step)} failed: {type(exc).__name__}: {exc}") from exc

    def remove_leftovers(self) -> None:
        """Remove what interrupted saves left: staging directories and uncommitted step dirs,
        after putting back any committed checkpoint an interrupted overwrite had set aside."""
        aside = {parse_step(self.backend.set_aside_for(name) or "") for name in self.backend.listdir(self.root)}
        for step in aside - {None}:
            self.backend.recover(self.path(step))
        for name in self.backend.listdir(self.root):
            step = parse_step(name)
            hidden = name.startswith(f".{STEP_PREFIX}") and (".tmp-" in name or RETIRED_MARK in name)
            if hidden or (step is not None and not self.is_committed(step) and self._only_saved_files(name)):
                self.backend.remove(self.backend.join(self.root, name))

    def _only_saved_files(self, name: str) -> bool:
        """Whether the uncommitted ``step-N`` holds only files a save writes (a save staged in
        place on an object store, cut short). Anything else there (a file of the user's, a file
        named like a step) is left as it is, with a warning: no save of statesnap's put it there."""
        path = self.backend.join(self.root, name)
        try:
            foreign = foreign_entries(self.backend, path)
        except OSError as exc:  # (not a directory)
            foreign = [f"{type(exc).__name__}: {exc}"]
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            log.warning("statesnap: %s has no manifest and holds what a save does not write (%s); left as it is, "
                        "and not a checkpoint to restore", path, shown)
        return not foreign


class MemoryLevel:
    """The newest resident snapshots still in the arena, by step."""

    def __init__(self):
        self._snapshots: dict[int, object] = {}
        self._lock = threading.Lock()

    def add(self, snap) -> None:
        with self._lock:
            self._snapshots[snap.step] = snap

    def drop(self, snap) -> None:
        with self._lock:
            if self._snapshots.get(snap.step) is snap:
                del self._snapshots[snap.step]

    def discard(self, step: int) -> None:
        with self._lock:
            self._snapshots.pop(step, None)

    def newest(self):
        with self._lock:
            return self._snapshots[max(self._snapshots)] if self._snapshots else None

    def snapshots(self) -> list:
        with self._lock:
            return list(self._snapshots.values())

    def clear(self) -> None:
        with self._lock:
            self._snapshots.clear()


def matching_target(snap, state: dict, fresh: list[tuple] | None = None, cast: bool = False):
    """The flattened ``state`` if its layout equals the snapshot's (same items, same boxes),
    its tensors in the snapshot's order; None if only the layout differs, or a precision that
    ``cast`` lets a stored copy convert (a stored copy of the step may still load). A state
    whose names, shapes or dtypes differ from the snapshot's is a ``StateMismatchError``: every
    copy of the step would refuse it. Flattening makes a fresh optimizer's state for the
    snapshot to fill: where the layout is another (or flattening fails), the optimizer is left
    fresh again, as a load that fails leaves it. Else a restart that found nothing to load went
    on with state made of zeros (an Rprop's step sizes, NAdam's ``mu_product``: not what its
    first step makes). ``fresh`` takes the optimizers that were fresh, for the caller to leave
    fresh again (``leave_fresh``) where the snapshot is not what it restores."""
    keys = sorted([*(m.fqn for m in snap.metas), *snap.objects])
    headers = {m.fqn: (m.shape, dtype_from_name(m.dtype)) for m in snap.metas}
    fresh = [] if fresh is None else fresh
    flat = None
    try:
        flat = flatten_for_load(state, StoredNames(keys, headers.get, plain_values(snap.objects)), fresh=fresh)
        # a tied weight the snapshot holds under one name only is filled under that one, as a load fills it
        lacking = [item.fqn for item in flat.tensors if item.fqn not in headers]
        tied = aliases_filled(flat.tensors, lacking, set(lacking))
        flat.tensors[:] = [item for item in flat.tensors if item.fqn not in tied]
        # in the snapshot's order: a fresh optimizer's state made from the stored names holds
        # its keys in their order, not in the order of the optimizer's own step (RMSprop's
        # step, square_avg, momentum_buffer), and was taken for another layout
        by_name = {item.fqn: item for item in flat.tensors}
        if len(by_name) == len(flat.tensors) == len(snap.metas) and all(m.fqn in by_name for m in snap.metas):
            flat.tensors[:] = [by_name[m.fqn] for m in snap.metas]
        metas = [item.meta(dtype_name(item.dtype)) for item in flat.tensors]
        if metas != snap.metas or sorted(o.fqn for o in flat.objects) != sorted(snap.objects):
            unfit, flat = flat, None
            _refuse_mismatch(unfit, snap, cast, [str(key) for key in state])
    finally:
        if flat is None:
            leave_fresh(fresh)
    return flat


class _Header(NamedTuple):
    shape: tuple
    dtype: torch.dtype


def _refuse_mismatch(flat, snap, cast: bool, top: list[str]) -> None:
    """Raise what a strict load of the snapshot's step from storage would: the target's names,
    shapes or dtypes differ from the snapshot's. Returning None for it made ``load_latest`` say
    "no checkpoint" of a step held in memory alone, and a loop started again from scratch."""
    headers = {m.fqn: _Header(tuple(m.shape), dtype_from_name(m.dtype)) for m in snap.metas}
    missing, mismatched, precision_only = mismatches(flat, headers.get, snap.objects, cast)
    mine = {item.fqn for item in flat.tensors} | {obj.fqn for obj in flat.objects}
    unexpected = [name for name in [*headers, *snap.objects] if name not in mine]
    if missing or mismatched or unexpected:
        raise mismatch_error(_memory_of(snap), missing, unexpected, mismatched, precision_only, top, False)


def leave_fresh(optimizers: list[tuple]) -> None:
    """Give the optimizers whose state was made for a snapshot in memory the state they had
    before (none, for fresh ones): ``(optimizer, its state before)``."""
    restore_emptied(optimizers)
    optimizers.clear()


def restore_from_memory(snap, flat, buffer: torch.Tensor, allow_pickle: bool, cast: bool = False) -> int:
    """Copy a resident snapshot back into the flattened target; return the bytes restored."""
    pairs, staged = _pairs_to_check(snap, flat, buffer)
    read_blob = lambda fqn, _ref: snap.blobs[fqn]  # noqa: E731 (pickled values kept in memory)
    objects, mismatched, precision_only = [], [], False
    for item in flat.objects:  # before any copy: a value the state cannot take leaves it as it was
        value = decode_value(item.fqn, snap.objects[item.fqn], allow_pickle, read_blob)
        if item.per_rank is None and not item.owned:  # (tensors held among plain values, as a load fits them)
            value, unfit, precision = fitted_to_held(item.fqn, item.value, value, cast)
            mismatched, precision_only = mismatched + unfit, precision_only or precision
        if item.check is not None:
            item.check(value)
        objects.append((item, value))
    if mismatched:
        raise mismatch_error(_memory_of(snap), [], [], mismatched, precision_only, [], False)
    base = snap.region.start
    nbytes = 0
    devices = set()
    try:
        with torch.no_grad():
            for item, offset in zip(flat.tensors, snap.item_offsets):
                # from the pinned arena a GPU copy runs asynchronously; one wait per device at the end
                devices.add(item.local.device)
                item.local.copy_(item_bytes_view(buffer, base + offset, item.local), non_blocking=True)
                nbytes += item.nbytes
    finally:  # a failure too: the region is handed back after this, so no copy may still read it
        for device in devices:
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
    names = overwritten(pairs, staged) if pairs else None
    if names is not None:
        raise tie_error(names, _memory_of(snap))
    for item, value in objects:
        if item.per_rank is not None:
            item.per_rank.restore(value)
        else:
            item.assign(value)
    for finalize in flat.finalizers:
        finalize()
    return nbytes


def _pairs_to_check(snap, flat, buffer: torch.Tensor) -> tuple[list, Callable]:
    """Targets sharing memory (engine/overlaps.py), and their staged snapshots: each must hold its
    snapshot's values once all are copied, or the state (tied weights the snapshot holds untied,
    views of one tensor it holds apart) cannot take the snapshot. One view under two names is
    decided here, before any copy, from the snapshots alone: alike, both copies put the same
    bytes there; apart, the state is refused untouched, as a load from storage refuses it."""
    pairs = overlapping_pairs(flat.tensors)
    offsets = {id(item): offset for item, offset in zip(flat.tensors, snap.item_offsets)} if pairs else {}

    def staged(item) -> torch.Tensor:
        return item_bytes_view(buffer, snap.region.start + offsets[id(item)], item.local)

    for a, b in pairs:
        if same_view(a, b) and not same_bits(staged(a), staged(b)):
            raise tie_error([a.fqn, b.fqn], _memory_of(snap))
    return [(a, b) for a, b in pairs if not same_view(a, b)], staged


def _memory_of(snap) -> str:
    return f"the snapshot of step {snap.step} in host memory"
