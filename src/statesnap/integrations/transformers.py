"""Hugging Face ``transformers.Trainer`` checkpoints through statesnap.

    trainer = StatesnapTrainer(model=model, args=args, train_dataset=data)  # a Trainer in all else
    trainer.train(resume_from_checkpoint=True)

Each checkpoint the Trainer makes (``save_steps``, ``save_strategy``) is a lazy snapshot of the
model, the optimizer, the LR scheduler, the gradient scaler (fp16), every rank's RNG states and the
``TrainerState`` (which holds the data position: epoch and step), taken by one
:class:`statesnap.Checkpointer` per output directory into ``<output_dir>/statesnap/step-N``.
``save`` returns once the snapshot is planned; the copy runs while the next forward and backward
run and the optimizer step waits for it. Once the step is committed, ``<output_dir>/checkpoint-N``
appears, holding the ``trainer_state.json`` the Trainer reads on resume and a pointer to the
statesnap checkpoint: the Trainer's own ``get_last_checkpoint`` and ``save_total_limit`` rotation
work unchanged, a crash never leaves a ``checkpoint-N`` that names an incomplete checkpoint, and a
statesnap step no ``checkpoint-N`` names any more is deleted. ``train(resume_from_checkpoint=...)``
restores everything in place, resharded if the world size changed (RNG states need the same world
size: the Trainer's data order depends on it anyway). ``export_pretrained`` writes the model as
``save_pretrained`` does (safetensors and ``config.json``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import threading
import uuid

from transformers import Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ..checkpointer import Checkpointer
from ..checkpointer.config import CheckpointerConfig
from ..engine.load import load, parts_lacking
from ..errors import CheckpointError, StateMismatchError, described
from ..reader import open as open_checkpoint
from ..state.wrappers import PerRank, Replicated
from .pointers import (
    POINTER_NAME, PointerFailures, fsync_directory, parse_pointer, pointer_bytes, read_pointer_file, step_of,
)
from .rng import RngStates

POINTER_FORMAT = "statesnap-transformers-1"
log = logging.getLogger("statesnap")
TRAINER_STATE_NAME = "trainer_state.json"
STORE_DIR = "statesnap"
KEEP_ALL = 1 << 30  # the Trainer's rotation decides what goes
MISMATCH_ADVICE = ("A StatesnapTrainer loads a checkpoint into the model it was saved from (the same config) and, to "
                   "resume, the same optimizer; to start from the weights that match, ss.load({'model': model}, "
                   "<that checkpoint>, strict=False) and train without resume_from_checkpoint.")


class _Ignored:
    def load_state_dict(self, state) -> None:
        pass


class StatesnapTrainer(Trainer):
    """``transformers.Trainer`` whose checkpoints are statesnap checkpoints (see the module).

    ``statesnap_settings``: settings of each output directory's :class:`statesnap.Checkpointer`
    (``host_memory_gb``, ``durable``, ``further_root``, ...), except ``keep_last``,
    ``persist_every`` and ``on_commit``, which the Trainer's settings decide."""

    def __init__(self, *args, statesnap_settings: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        fixed = sorted(set(statesnap_settings or {}) & {"keep_last", "persist_every", "on_commit"})
        if fixed:
            raise CheckpointError(f"StatesnapTrainer sets {', '.join(fixed)} itself")
        CheckpointerConfig.check_names(statesnap_settings or {})
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise CheckpointError("StatesnapTrainer does not take over DeepSpeed's or FSDP's checkpoints; use "
                                  "the Trainer, or convert its checkpoints with ss.convert")
        self._statesnap_settings = dict(statesnap_settings or {})
        self._checkpointers: dict[str, Checkpointer] = {}
        self._waiting: dict[int, tuple[str, str]] = {}  # step in flight -> (run dir, trainer state JSON)
        self._waiting_lock = threading.Lock()
        self._failures = PointerFailures()  # checkpoint-N directories that could not be made
        self._unmade: set[int] = set()  # their steps: kept stored, though no checkpoint-N names them

    # ----------------------------------------------------------------- saving

    def _save_checkpoint(self, model, trial) -> None:
        self._failures.raise_first()
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        step = self.state.global_step
        self._note_best_checkpoint(run_dir, step)
        self._record_callback_states()
        trainer_state = json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"
        # The TrainerState differs between ranks (is_world_process_zero, ...): the main process's is
        # stored, as the Trainer writes the main process's trainer_state.json.
        state = {"model": self.accelerator.unwrap_model(self.model),
                 "rng": PerRank(RngStates()), "trainer": {"state": Replicated(trainer_state)}}
        if not self.args.save_only_model:
            state.update(optimizer=_torch_optimizer(self.optimizer), scheduler=self.lr_scheduler)
            if getattr(self.accelerator, "scaler", None) is not None:  # fp16: the loss scale, as the Trainer saves it
                state["scaler"] = self.accelerator.scaler
        with self._waiting_lock:
            self._waiting[step] = (run_dir, trainer_state)
        try:
            self._checkpointer(run_dir).save(step, state)
        except BaseException:
            with self._waiting_lock:
                self._waiting.pop(step, None)
            raise

    def _note_best_checkpoint(self, run_dir: str, step: int) -> None:
        """``best_model_checkpoint`` as the Trainer sets it when it saves (rotation keeps that
        directory, ``load_best_model_at_end`` loads it). The Trainer looks for the best step's
        directory, which here appears only once the step is committed: a step in flight, or
        this one, counts as there."""
        best = getattr(self.state, "best_global_step", None)  # (transformers before 4.50 set no such field)
        if not best or self.args.save_strategy not in ("steps", "epoch", "best"):
            return
        with self._waiting_lock:
            in_flight = best == step or best in self._waiting
        directory = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
        if in_flight or os.path.exists(directory):
            self.state.best_model_checkpoint = directory

    def _record_callback_states(self) -> None:
        """The stateful callbacks' state into ``TrainerState``, as the Trainer does before saving."""
        for callback in [*self.callback_handler.callbacks, self.control]:
            if isinstance(callback, ExportableState):
                name = callback.__class__.__name__
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(callback.state())
                else:
                    self.state.stateful_callbacks[name] = callback.state()

    def _checkpointer(self, run_dir: str) -> Checkpointer:
        ckpt = self._checkpointers.get(run_dir)
        if ckpt is None:
            ckpt = self._checkpointers[run_dir] = Checkpointer(
                os.path.join(run_dir, STORE_DIR), keep_last=KEEP_ALL, persist_every=1,
                on_commit=self._committed, **self._statesnap_settings)
            if self.args.should_save:
                self._clear_leftovers(run_dir, ckpt)
        return ckpt

    def _clear_leftovers(self, run_dir: str, ckpt: Checkpointer) -> None:
        """What a crash left: a ``checkpoint-N`` being made, and committed steps it never named."""
        for name in os.listdir(run_dir):
            if name.startswith(f".{PREFIX_CHECKPOINT_DIR}-") and ".tmp-" in name:
                shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
        for step in _unnamed_steps(run_dir):
            ckpt.remove(step)

    def _committed(self, record) -> None:
        """On commit (the Checkpointer's flush thread): make ``checkpoint-N``, rotate as the
        Trainer does, and delete the statesnap steps no ``checkpoint-N`` names any more. A
        ``checkpoint-N`` that cannot be made (a full disk) is raised at the next save and when
        training ends, as a failed save is: the Checkpointer would only log it."""
        with self._waiting_lock:
            run_dir, trainer_state = self._waiting.pop(record.step)
        if not self.args.should_save:  # the main process writes the directories
            return
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{record.step}")
        try:
            _make_pointer_dir(final, record.step, trainer_state)
        except Exception as exc:  # noqa: BLE001 (raised on the training thread)
            error = CheckpointError(f"step {record.step} was committed to {record.path}, but {final} could not be "
                                    f"made ({described(exc)}), so the Trainer cannot resume from it")
            error.__cause__ = exc
            self._unmade.add(record.step)
            self._failures.add(error)
            return
        rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                           best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)
        for step in _unnamed_steps(run_dir):
            if step != record.step and step not in self._unmade:
                self._checkpointers[run_dir].remove(step)

    def train(self, resume_from_checkpoint=None, trial=None, *args, **kwargs):
        try:
            if self.args.save_strategy != "no":
                # Claim the store before anything runs: a second job on this output directory is
                # refused now, not at its first save (after up to save_steps steps of training).
                self._checkpointer(self._get_output_dir(trial=trial))
            return super().train(resume_from_checkpoint, trial, *args, **kwargs)
        finally:
            self.close_checkpoints()

    def close_checkpoints(self) -> None:
        """Finish every checkpoint in flight (``train`` does it when it returns), and raise what
        failed."""
        try:
            for ckpt in list(self._checkpointers.values()):
                ckpt.close()  # its last commits still find it
        finally:
            self._checkpointers = {}
        self._failures.raise_first()

    def _finalize_training(self, *args, **kwargs):
        # The Trainer looks at the best checkpoint's directory here (loading it, or sparing it
        # from rotation), which appears only once its step is committed.
        self.close_checkpoints()
        return super()._finalize_training(*args, **kwargs)

    # ----------------------------------------------------------------- resuming

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        target = pointer_target(resume_from_checkpoint)
        if target is None:  # a checkpoint the Trainer wrote itself
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        model = self.accelerator.unwrap_model(model if model is not None else self.model)
        _load_part(resume_from_checkpoint, target, {"model": model})

    def _load_best_model(self) -> None:
        self.close_checkpoints()  # training is over; the best step may still be in flight
        target = pointer_target(self.state.best_model_checkpoint)
        if target is None:
            return super()._load_best_model()
        _load_part(self.state.best_model_checkpoint, target, {"model": self.accelerator.unwrap_model(self.model)})

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        target = pointer_target(checkpoint) if checkpoint else None
        if target is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        with _loading_from(checkpoint, target):
            stored = open_checkpoint(target).keys()
            if parts_lacking(stored, ["optimizer"]):
                return  # saved with save_only_model: both start afresh, as the Trainer's do (the model is loaded)
            # Optimizer state is stored by parameter name, which the model gives: it comes along. The
            # RNG states are restored later, where the Trainer restores them (rng: a stand-in here),
            # so this load is strict: anything of the checkpoint left unmatched is an error.
            model = self.accelerator.unwrap_model(self.model)
            state = {"model": model, "optimizer": _torch_optimizer(self.optimizer), "scheduler": self.lr_scheduler,
                     "rng": PerRank(_Ignored(), on_resize="skip"), "trainer": {"state": None}}
            if not parts_lacking(stored, ["scaler"]):
                state["scaler"] = _scaler_or_stand_in(self.accelerator, stored)
            load(state, target)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        target = pointer_target(checkpoint) if checkpoint else None
        if target is None:
            return super()._load_rng_state(checkpoint)
        # another world size: the Trainer's data order changes too; it goes on, as the Trainer does
        _load_part(checkpoint, target, {"rng": PerRank(RngStates(), on_resize="skip")})

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint and pointer_target(checkpoint) is None:
            super()._load_scaler(checkpoint)
        # (a statesnap checkpoint's scaler came with the optimizer, just before)


def export_pretrained(trainer: Trainer, checkpoint: str, output_dir: str) -> None:
    """Write the model of ``checkpoint`` (a ``checkpoint-N`` of a StatesnapTrainer) as
    ``save_pretrained`` does: ``model.safetensors`` and ``config.json``, which
    ``from_pretrained`` loads. The model is loaded into the trainer's model first."""
    target = pointer_target(checkpoint)
    if target is None:
        raise CheckpointError(f"{checkpoint} is not a checkpoint of a StatesnapTrainer")
    model = trainer.accelerator.unwrap_model(trainer.model)
    _load_part(checkpoint, target, {"model": model})
    model.save_pretrained(output_dir, safe_serialization=True)


def pointer_target(checkpoint_dir: str) -> str | None:
    """The statesnap checkpoint a ``checkpoint-N`` directory names (None if it is the Trainer's own)."""
    path = os.path.join(checkpoint_dir, POINTER_NAME)
    try:
        pointer = parse_pointer(read_pointer_file(path), POINTER_FORMAT, path)
    except FileNotFoundError:
        return None
    if pointer is None:  # (only statesnap writes this file)
        raise CheckpointError(f"{path} is damaged: it is not a statesnap pointer; restore it, or resume from "
                              "another checkpoint")
    return os.path.join(os.path.dirname(os.path.abspath(checkpoint_dir)), pointer[0])


def _load_part(checkpoint_dir: str, target: str, part: dict) -> None:
    """Load ``part`` of the checkpoint that ``checkpoint_dir`` names (at ``target``) in place,
    refusing a part it lacks and one that differs from it (``partial``: under the part's names,
    both sides must match; a model of fewer layers is refused too)."""
    with _loading_from(checkpoint_dir, target):
        lacking = parts_lacking(open_checkpoint(target).keys(), list(part))
        if lacking:
            raise CheckpointError(f"{target} holds no {lacking[0]!r} (saved with save_only_model?)")
        load(part, target, partial=True)


@contextlib.contextmanager
def _loading_from(checkpoint_dir: str, target: str):
    """Errors of a load from the step ``checkpoint_dir`` names, said so that a Trainer's user can act:
    a step that is gone is named with the pointer that led there, and a state that does not match
    gets advice the Trainer can follow (it has no ``strict=False``)."""
    try:
        yield
    except StateMismatchError as exc:
        raise exc.advised(MISMATCH_ADVICE) from None
    except CheckpointError as exc:
        if os.path.exists(target):
            raise
        raise CheckpointError(f"{os.path.join(checkpoint_dir, POINTER_NAME)} names {target}, which is not there "
                              f"(deleted, or not copied along with {checkpoint_dir}): pass another checkpoint-N as "
                              f"resume_from_checkpoint, or delete {checkpoint_dir}") from exc


def _scaler_or_stand_in(accelerator, stored: list[str]):
    """The gradient scaler to restore the checkpoint's into: fp16's. A checkpoint of an fp16 run
    resumed without fp16 (no scaler) leaves the loss scale, which is of no use there, unloaded
    (a stand-in of the stored names takes it); the Trainer's own resume fails then."""
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        return scaler
    return {name[len("scaler."):]: None for name in stored if name.startswith("scaler.")}


def _torch_optimizer(optimizer):
    """accelerate wraps the optimizer; the torch optimizer inside is what holds the state."""
    return getattr(optimizer, "optimizer", optimizer)


def _make_pointer_dir(final: str, step: int, trainer_state: str) -> None:
    """``checkpoint-N`` with the Trainer's state and the pointer, made whole, then renamed in."""
    parent = os.path.dirname(final)
    staging = os.path.join(parent, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(staging)
    for name, data in ((TRAINER_STATE_NAME, trainer_state.encode()),
                       (POINTER_NAME, pointer_bytes(POINTER_FORMAT, f"{STORE_DIR}/step-{step}"))):
        with open(os.path.join(staging, name), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    if os.path.isdir(final):  # the step saved again (a resumed run): replace the old directory
        shutil.rmtree(final)
    os.rename(staging, final)
    fsync_directory(parent)


def _pointer_dirs(run_dir: str) -> list[str]:
    prefix = f"{PREFIX_CHECKPOINT_DIR}-"
    return [os.path.join(run_dir, n) for n in os.listdir(run_dir) if n.startswith(prefix)]


def _unnamed_steps(run_dir: str) -> list[int]:
    """The stored steps no ``checkpoint-N`` names; none while a ``checkpoint-N``'s pointer cannot
    be read, since the step it named must not be taken for one (deleting it could lose it)."""
    named, unreadable = set(), []
    for directory in _pointer_dirs(run_dir):
        try:
            target = pointer_target(directory)
        except CheckpointError:
            target = None
        if target is not None:
            named.add(step_of(target))
        elif os.path.exists(os.path.join(directory, POINTER_NAME)):
            unreadable.append(directory)
    unnamed = sorted(set(_stored_steps(run_dir)) - named)
    if unreadable and unnamed:
        log.warning("%s: kept steps %s, which no readable pointer names, because %s cannot be read",
                    run_dir, unnamed, ", ".join(os.path.join(d, POINTER_NAME) for d in unreadable))
        return []
    return unnamed


def _stored_steps(run_dir: str) -> list[int]:
    store = os.path.join(run_dir, STORE_DIR)
    names = os.listdir(store) if os.path.isdir(store) else []
    return [s for s in map(step_of, names) if s is not None]
