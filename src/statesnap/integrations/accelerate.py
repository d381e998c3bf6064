"""Hugging Face accelerate: what ``Accelerator.save_state`` saves, through statesnap, lazily.

    accelerator = Accelerator(cpu=True)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    checkpoints = AcceleratorCheckpoints(accelerator, "ckpt", keep_last=3)
    start = checkpoints.load_latest() or 0          # the step to go on from (0: a fresh run)
    for step, batch in enumerate(accelerator.skip_first_batches(data, start), start + 1):
        ...                                          # forward, accelerator.backward, optimizer.step
        checkpoints.save(step)                       # returns at once; the copy overlaps the next step
    checkpoints.close()

``save_state`` writes every prepared model, optimizer and scheduler, the objects given to
``register_for_checkpointing``, the gradient scaler (fp16), the gradient-accumulation counter, the
positions of stateful data loaders (``use_stateful_dataloader=True``: they then go on within
their epoch by themselves, so iterate them without skipping) and each process's RNG states
with ``torch.save``, blocking. :class:`AcceleratorCheckpoints` saves the same set as a lazy
snapshot of a :class:`statesnap.Checkpointer` (atomic commits, checksums, retention, the levels of
docs/checkpointer.md): models unwrapped (DDP's ``module.`` prefix is not stored), optimizers
through the torch optimizer inside accelerate's wrapper (whose step the snapshot waits for), and
RNG states per rank. ``load_latest`` restores them in place, resharded if the layout changed.
"""
from __future__ import annotations

import logging

from ..checkpointer import Checkpointer
from ..errors import StateMismatchError
from ..state.wrappers import PerRank, Replicated
from .rng import RngStates

log = logging.getLogger("statesnap")
MISMATCH_ADVICE = ("AcceleratorCheckpoints restores into what it saved: prepare the same models (the same config), "
                   "optimizers and schedulers and register the same objects, or start afresh under another root.")


class AcceleratorCheckpoints:
    """Checkpoints of an ``accelerate.Accelerator``'s prepared objects; ``settings`` are
    :class:`statesnap.Checkpointer`'s (``keep_last``, ``host_memory_gb``, ``persist_every``, ...)."""

    def __init__(self, accelerator, root, **settings):
        self.accelerator = accelerator
        self.ckpt = Checkpointer(root, **settings)

    def state(self) -> dict:
        """What ``save_state`` saves, as a statesnap state (made anew each time: objects prepared
        later are included)."""
        acc = self.accelerator
        state = {
            "models": {str(i): acc.unwrap_model(m) for i, m in enumerate(acc._models)},
            "optimizers": {str(i): getattr(o, "optimizer", o) for i, o in enumerate(acc._optimizers)},
            "schedulers": {str(i): s for i, s in enumerate(acc._schedulers)},
            # save_state saves registered objects from the main process and load_state gives every
            # rank that state: one copy, not compared across ranks (a per-rank object failed the save)
            "custom": {str(i): Replicated(o) for i, o in enumerate(acc._custom_objects)},
            "accelerator": {"step": _Counter(acc)},
            "rng": PerRank(rng := RngStates(), on_resize=_own_rank_if_saved(rng)),
        }
        if getattr(acc, "scaler", None) is not None:  # fp16: the loss scale, backed off at overflows
            state["scaler"] = acc.scaler
        # Stateful data loaders (use_stateful_dataloader=True): the position within the epoch, per rank.
        # On another world size every rank takes rank 0's, as save_state's one file gives every rank.
        loaders = {str(i): PerRank(dl, on_resize="rank0") for i, dl in enumerate(acc._dataloaders)
                   if getattr(dl, "use_stateful_dataloader", False)}
        if loaders:
            state["dataloaders"] = loaders
        return state

    def save(self, step: int):
        """Snapshot everything as ``step``; returns the Checkpointer's handle at once."""
        return self.ckpt.save(step, self.state())

    def load_latest(self) -> int | None:
        """Restore the newest committed step in place; return it (None: nothing saved yet). A
        checkpoint saved before the gradient scaler or the data loaders' positions were saved
        restores the rest, with a warning: the scaler then starts from its initial scale, the
        data loaders from the start of their epoch. So does a data loader prepared only after
        the save (an evaluation loader made at the first evaluation), and a position stored for
        a data loader not prepared now is left unread, with a warning, as ``load_state`` leaves
        it."""
        state = self.state()
        try:
            return self._load_latest(state)
        except StateMismatchError as exc:
            if not _left_out(state, exc):
                raise
        return self._load_latest(state)

    def _load_latest(self, state: dict) -> int | None:
        try:
            return self.ckpt.load_latest(state)
        except StateMismatchError as exc:  # with advice this class can follow: it has no strict=False
            raise exc.advised(MISMATCH_ADVICE) from None

    @property
    def loaded_from(self) -> str | None:
        return self.ckpt.loaded_from

    def close(self) -> None:
        self.ckpt.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _left_out(state: dict, exc: StateMismatchError) -> bool:
    """Adapt ``state`` to a checkpoint whose only differences from it are parts it can go
    without, with a warning for each: the gradient scaler it lacks (saved before the scaler
    was), the position of a data loader it lacks (saved before positions were, or before that
    loader was prepared: it starts its epoch), the position of a data loader not prepared now
    (a stand-in takes it). False, leaving ``state`` alone, where anything else differs.
    Before, one loader more or less on either side failed the resume, and a checkpoint that
    held some positions was taken for one of an earlier version: all were left out, then
    refused as unexpected."""
    loaders = state.get("dataloaders", {})
    no_scaler, lacking, unprepared = False, set(), set()
    for name in exc.missing:
        part, index = _part_and_index(name)
        if part == "scaler" and part in state:
            no_scaler = True
        elif part == "dataloaders" and index in loaders:
            lacking.add(index)
        else:
            return False
    for name in exc.unexpected:
        part, index = _part_and_index(name)
        if part != "dataloaders" or not index or index in loaders:
            return False
        unprepared.add(index)
    if exc.mismatched or not (no_scaler or lacking or unprepared):
        return False
    if no_scaler:
        log.warning("statesnap: the checkpoint holds no gradient scaler (saved before it was); restoring the rest, "
                    "the scaler starts from its initial scale")
        del state["scaler"]
    if lacking:
        log.warning("statesnap: the checkpoint holds no position of data loader %s (saved before positions were, or "
                    "before the loader was prepared); restoring the rest, the loader starts from the beginning of its "
                    "epoch", ", ".join(sorted(lacking, key=int)))
        for index in lacking:
            del loaders[index]
    if unprepared:
        log.warning("statesnap: the checkpoint holds the position of data loader %s, which is not prepared now; it is "
                    "left unread, as load_state leaves it", ", ".join(sorted(unprepared, key=int)))
        state["dataloaders"] = loaders = {**loaders, **{index: PerRank(_Unread(), on_resize="rank0")
                                                        for index in unprepared}}
    if not loaders:
        state.pop("dataloaders", None)
    return True


def _part_and_index(name: str) -> tuple[str, str]:
    """A stored name's part of the state and the key under it (``dataloaders.1.x``: dataloaders, 1)."""
    part, _, rest = name.partition(".")
    return part, rest.split(".", 1)[0]


class _Unread:
    """Takes a stored data loader's position and leaves it unread."""

    def load_state_dict(self, state) -> None:
        pass


def _own_rank_if_saved(rng: RngStates):
    """``on_resize`` of the RNG states, as ``load_state`` maps them on another number of
    processes: each rank takes the states the rank of its number saved, and a rank the saving
    job did not have keeps its own."""
    return lambda saved, rank, world_size: saved[rank] if rank < len(saved) else rng.state_dict()


class _Counter:
    """The accelerator's gradient-accumulation counter, saved and restored like a stateful object."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def state_dict(self) -> dict:
        return {"step": self.accelerator.step}

    def load_state_dict(self, state: dict) -> None:
        self.accelerator.step = state["step"]
