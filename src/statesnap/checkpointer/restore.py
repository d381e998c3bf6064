"""What ``Checkpointer.load_latest`` restores: the newest committed step any level holds, from
the fastest level holding it, with every rank choosing and moving on together.

Every rank learns in one exchange what the others hold in host memory and on their nodes, and
what rank 0 lists on the storage levels: a restart's time is its slowest rank's, collectives
included. The copies are then tried newest step first, fastest level first (memory, node-local,
persistent, further); what a failure lets the ranks go past is ``fallback.py``'s to say, and the
node-local level's restore, files fetched from other nodes included, is ``recovery.py``'s.
"""
from __future__ import annotations

import logging
import warnings


from ..engine.dist import Comm
from ..engine.load import load_step
from ..errors import CheckpointError, CorruptCheckpointError, described
from ..storage.retry import describe
from .config import CheckpointerConfig
from .fallback import Fallback
from .levels import MemoryLevel, StorageLevel, leave_fresh, matching_target, restore_from_memory
from .recovery import LocalRecovery, complete_steps, inventory, unusable_steps
from .staging import Arena

log = logging.getLogger("statesnap")


def load_newest(state: dict, cast: bool, comm: Comm, memory: MemoryLevel, arena: Arena | None,
                levels: list[StorageLevel], recovery: LocalRecovery | None,
                config: CheckpointerConfig) -> tuple[int, str, int] | None:
    """Restore the newest committed step into ``state``; return (the step, the name of the level
    it came from, the bytes restored), or None if no level holds one. ``levels``: the shared
    storage levels, fastest first; ``recovery``: the node-local level's, where there is one."""
    local = recovery.level if recovery is not None else None
    snap, refused = memory.newest(), None
    if snap is not None and snap.release() is not None:
        # the last look at its counters (no commit took it): a tensor changed in place right
        # after save() may have changed under its copy; the snapshot may mix two steps
        log.warning("statesnap: the snapshot of step %d in host memory is not restored: %s", snap.step, snap.error)
        memory.drop(snap)
        snap = None
    # Optimizers that were fresh and got state made for the snapshot in memory: left fresh
    # again unless that snapshot is what restores them (the ranks chose another step, the
    # snapshot went, its restore failed), as a load from storage that fails leaves them.
    # Else a restart that found nothing else to load went on with state made of zeros.
    made: list[tuple] = []
    try:
        flat = matching_target(snap, state, made, cast) if snap is not None else None
    except Exception as exc:  # noqa: BLE001 (a state no load can fill: raised on every rank below)
        flat, refused = None, exc
    # a step in memory that this state's layout cannot take (a stored copy of it may)
    unfit = snap.step if snap is not None and flat is None and refused is None else None
    borrowed = flat is not None and arena.borrow(snap.region)
    from_memory = False
    try:
        # what each rank holds in memory and on its node, and rank 0's listing of the stored
        # levels, in one exchange
        held = comm.all_gather((snap.step if borrowed else None,
                                inventory(local) if local is not None else None,
                                _stored_steps(levels) if comm.rank == 0 else None,
                                unfit, described(refused)))
        # a rank whose state no load can fill (a target refused by name) stops every rank
        # here, not only itself while the others wait for it in the next exchange
        comm.raise_any(refused, [failure for *_, failure in held], "loading the latest checkpoint")
        memory_steps = [step for step, *_ in held]
        memory_step = memory_steps[0] if None not in memory_steps and len(set(memory_steps)) == 1 else None
        inventories = [node[0] for _, node, *_ in held] if local is not None else []
        stored = held[0][2]
        local_steps = complete_steps(inventories) if inventories else []
        unusable = unusable_steps(inventories, [node[1] for _, node, *_ in held]) if inventories else {}
        # a level that could not be listed holds its error's text instead of its steps
        listed = [steps if isinstance(steps, list) else [] for steps in stored]
        choices = [(memory_step, 0, "memory")] + [(s, 1, "local") for s in local_steps] + [
            (s, i + 2, lv.name) for i, (steps, lv) in enumerate(zip(listed, levels)) for s in steps]
        choices = sorted((c for c in choices if c[0] is not None), key=lambda c: (-c[0], c[1]))
        unlisted = [(lv, why) for why, lv in zip(stored, levels) if isinstance(why, str)]
        if not choices and unlisted:
            # None says "no checkpoint": the loop would train from scratch, and its saves
            # would replace and retire the checkpoints that level still holds
            raise CheckpointError(
                "no checkpoint to restore was found, but " + "; ".join(
                    f"the {lv.name} level at {lv.root} could not be listed ({why})" for lv, why in unlisted) +
                ": it may hold checkpoints; try again once the storage answers")
        newest_unfit = max((step for *_, step, _ in held if step is not None), default=None)
        first = choices[0] if choices else None
        passed = [_unfit_memory(newest_unfit, first)] if newest_unfit is not None and (
            first is None or first[0] < newest_unfit) else []
        passed += [f"step {step} on the node-local level at {local.root} cannot be restored ({why})"
                   for step, why in sorted(unusable.items(), reverse=True) if first is None or step >= first[0]]
        _pass_over(passed, first, CorruptCheckpointError if unusable else CheckpointError)
        if not choices:
            return None
        options = dict(allow_pickle=config.allow_pickle, storage_options=config.storage_options,
                       process_group=config.process_group, timeout_s=config.commit_timeout_s, cast=cast)
        by_name = {level.name: level for level in levels}
        # the newest step first, from the fastest level holding it
        fallback = Fallback(comm, choices)
        emptied = False  # whether a stored copy tried first took the state made for the snapshot away
        for index, (step, _, name) in enumerate(choices):
            try:
                if name == "memory":
                    nbytes = _restore_memory(comm, arena, snap, flat, step, config.allow_pickle, cast,
                                             (state, made, cast) if emptied else None)
                    from_memory = True
                else:
                    emptied = emptied or bool(made)
                    leave_fresh(made)
                    nbytes, name = _restore_stored(state, step, name, inventories, by_name, recovery, options)
                break
            except CheckpointError as exc:
                if fallback.record(exc, index) and name == "local":
                    recovery.prune_after(step - 1)  # a copy given up is not tried again at the next restart
                fallback.go_on_or_raise(exc, index)
        for damaged_step, level_name in fallback.damaged:
            if level_name in by_name:  # (not the node's own levels: they prune what they give up)
                by_name[level_name].damaged.add(damaged_step)
        if recovery is not None:
            recovery.prune_after(step)
    finally:
        if not from_memory:
            leave_fresh(made)
        if borrowed:
            arena.hold(snap.region, lambda: memory.drop(snap))
    return step, name, nbytes


def _unfit_memory(step: int, first: tuple | None) -> str:
    """Why the newest step, held in host memory in another layout than the state's, is not what
    this restore gives (and what to do if nothing else can be: ``first`` is None)."""
    why = (f"step {step} is held in host memory only in the layout it was saved from (its sharding, dtypes and "
           "placements), and this state's layout differs: a snapshot in memory restores only into that layout")
    return why if first is not None else (
        f"{why}, and no level holds a stored copy to reshard. Restore it into a state laid out as it was saved "
        "(and save it once, to have a copy on storage)")


def _pass_over(passed: list[str], first: tuple | None, error: type[CheckpointError]) -> None:
    """Warn of each newer step in ``passed`` (why it cannot be restored) that the restore goes
    past for its ``first`` choice: one passed over without a word was deleted by the restart with
    the steps after the one it restored. With no choice left, raise ``error``: None would say
    "no checkpoint", and the loop would start again from scratch."""
    if passed and first is None:
        raise error("no checkpoint can be restored: " + "; ".join(passed))
    for problem in passed:  # (as fallback.py warns of a copy given up: on the log and as a warning)
        message = f"statesnap: {problem}; restoring step {first[0]} from the {first[2]} level instead"
        log.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _stored_steps(levels: list[StorageLevel]) -> list[list[int] | str]:
    """Rank 0: the committed steps of each storage level. A level it cannot list (the
    storage is down) holds none for this restore (the error's text instead of its steps), with a
    warning, rather than raising here while the other ranks wait for the answer: the other
    levels may still serve the restart."""
    steps = []
    for level in levels:
        try:
            steps.append(level.committed_steps())
        except Exception as exc:  # noqa: BLE001 (any storage library's error)
            log.warning("statesnap: the %s level at %s cannot be listed (%s); restoring without it",
                        level.name, level.root, describe(exc))
            steps.append(describe(exc))
    return steps


def _restore_memory(comm: Comm, arena: Arena, snap, flat, step: int, allow_pickle: bool, cast: bool,
                    remake: tuple | None = None) -> int:
    """Restore ``snap`` from the arena into ``flat``, on every rank or (raised) on none.
    ``remake``: (state, made) whose fresh optimizers lost the state made for the snapshot to
    a stored copy of a newer step tried first (it failed): the target is flattened again, so
    that they get it back. Without it their ``load_state_dict`` found them without state,
    and PyTorch's helper took a step at lr 0 to make one (their step hooks ran)."""
    error, nbytes = None, 0
    try:
        if remake is not None:
            flat = matching_target(snap, *remake)
            if flat is None:
                raise CheckpointError(f"the snapshot of step {step} in host memory no longer matches the state")
        nbytes = restore_from_memory(snap, flat, arena.buffer, allow_pickle, cast)
    except Exception as exc:  # noqa: BLE001 (all ranks raise together below)
        error = exc
    comm.agree(error, f"restoring step {step} from host memory")
    return nbytes


def _restore_stored(state: dict, step: int, name: str, inventories: list, by_name: dict[str, StorageLevel],
                    recovery: LocalRecovery | None, options: dict) -> tuple[int, str]:
    """Load ``step`` from a storage level with ``ss.load``'s ``options``; return the bytes read
    and the level's name (``"local"`` becomes ``"peer"`` when some node fetched files from another)."""
    if name == "local":
        nbytes, fetched = recovery.restore(state, step, inventories, **options)
        return nbytes, "peer" if fetched else "local"
    return load_step(state, by_name[name].path(step), step, **options).bytes, name
