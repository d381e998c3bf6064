"""torchtitan adapter: its checkpoint manager's role (save every ``interval`` steps, ``load(step)``,
``keep_latest_k``, async saves) played by :class:`statesnap.Checkpointer` instead of DCP.

torchtitan hands its checkpoint manager ``Stateful`` objects: a ``ModelWrapper`` (the model parts'
state dicts flattened into one, DTensors under FSDP2/TP), an ``OptimizersContainer`` (a torch
``Optimizer`` whose ``state_dict`` is flat and keyed by parameter name), the LR schedulers, the
dataloader and the trainer itself (``train_state``). They are saved through their own
``state_dict``/``load_state_dict``, as torchtitan's DCP manager does, so the files hold torchtitan's
names and the DTensors reshard when a run resumes on another mesh. Three things differ from handing
them to ``ss.save`` as they are:

- the optimizer container goes through its ``state_dict`` (torchtitan's flat, name-keyed form),
  not statesnap's optimizer path, which would need the owning module and keys state by position
  for a container whose own ``state`` is empty;
- its ``step`` is guarded (``Checkpointer.guard``): it waits until the snapshot in flight is
  copied, because it writes the parameters and optimizer state the snapshot still reads. This is
  the moment torchtitan's trainer calls ``maybe_wait_for_staging``, and it also holds for loops
  that do not call it;
- the dataloader's state is per rank (``ss.PerRank``): torchtitan keys it by data-parallel rank and
  refuses to load it into another data-parallel size, so a resharded resume names ``"dataloader"``
  in ``exclude_from_loading``, as with DCP.

``TorchtitanCheckpointer`` needs only torch. ``StatesnapCheckpointManager``, the class torchtitan's
trainer builds from ``Trainer.Config.checkpoint``, is made on first use and needs torchtitan::

    from statesnap.integrations.torchtitan import StatesnapCheckpointManager
    config.checkpoint = StatesnapCheckpointManager.Config(enable=True, interval=100, keep_latest_k=3)
"""
from __future__ import annotations

import logging
import sys
from typing import Any

import torch

import statesnap as ss

from ..engine.load import load_step, parts_lacking
from ..errors import CheckpointError, StateMismatchError

log = logging.getLogger("statesnap")
MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE = (
    "model", "optimizer", "lr_scheduler", "dataloader", "train_state")  # torchtitan's state names
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
MISMATCH_ADVICE = ("The checkpointer loads into the model config the checkpoint was saved with; name the states not "
                   "to load in exclude_from_loading, or start afresh in another folder.")


class _ThroughStateDict:
    """Saves and loads an object through its own ``state_dict``/``load_state_dict`` only (for a
    torch optimizer, whose type would otherwise send it down statesnap's optimizer path)."""

    def __init__(self, obj):
        self.obj = obj

    def state_dict(self) -> dict:
        return self.obj.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.obj.load_state_dict(state_dict)


class TorchtitanCheckpointer:
    """torchtitan's checkpoint policy over an ``ss.Checkpointer`` rooted at ``folder``
    (``folder/step-N``, as torchtitan names its checkpoints).

    ``states`` maps names to ``Stateful`` objects; the names torchtitan uses (``model``,
    ``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state``) get the treatment in the
    module docstring, and ``model`` alone is loaded from a step-0 (seed) checkpoint. A ``None``
    value (no dataloader) is left out. The other arguments are those of torchtitan's
    ``checkpoint`` config, with ``export_dtype`` a torch dtype; ``settings`` go to
    ``ss.Checkpointer`` (``host_memory_gb``, ``storage_options``, ...).
    """

    def __init__(self, folder: str, states: dict[str, Any], *, interval: int = 500, keep_latest_k: int = 10,
                 async_mode: str = "async", load_only: bool = False, exclude_from_loading: list[str] = (),
                 enable_first_step_checkpoint: bool = False, last_save_model_only: bool = True,
                 export_dtype: torch.dtype = torch.float32, initial_load_path: str | None = None,
                 initial_load_model_only: bool = True, **settings):
        if async_mode not in ASYNC_MODES:
            raise CheckpointError(f"async_mode must be one of {ASYNC_MODES}, not {async_mode!r}")
        if keep_latest_k == 1 and last_save_model_only:
            raise CheckpointError("keep_latest_k=1 with last_save_model_only=True: the model-only last save would "
                                  "retire the only checkpoint a run can resume from. Keep 2 or more (torchtitan's "
                                  "own manager refuses 1), or 0 to keep all, or pass last_save_model_only=False")
        unknown = [k for k in exclude_from_loading if k not in states]
        if unknown or MODEL in exclude_from_loading:
            raise CheckpointError(f"exclude_from_loading names {unknown or [MODEL]}: the state holds "
                                  f"{sorted(states)}, and {MODEL!r} is always loaded")
        self.folder, self.states, self.interval = folder, states, interval
        self.blocking = async_mode == "disabled"
        self.load_only, self.exclude_from_loading = load_only, list(exclude_from_loading)
        self.enable_first_step_checkpoint = enable_first_step_checkpoint
        self.last_save_model_only, self.export_dtype = last_save_model_only, export_dtype
        self.initial_load_path, self.initial_load_model_only = initial_load_path, initial_load_model_only
        self.save_future = None  # the last save's durable future (async modes), as torchtitan names it
        self.ckpt = ss.Checkpointer(folder, keep_last=keep_latest_k or sys.maxsize, **settings)
        optimizer = states.get(OPTIMIZER)
        if isinstance(optimizer, torch.optim.Optimizer):
            self.ckpt.guard(optimizer, "step")

    # ------------------------------------------------------------------ the manager's interface

    def should_save(self, step: int, last_step: bool = False) -> bool:
        if self.load_only:
            return False
        return last_step or step % self.interval == 0 or (step == 1 and self.enable_first_step_checkpoint)

    @torch.no_grad()
    def save(self, step: int, last_step: bool = False) -> bool:
        """Checkpoint ``step`` if the policy says so; returns whether it did. Async modes return once
        the snapshot is planned (the copy and the write run in the background); the last step, and
        every step with ``async_mode="disabled"``, returns once the checkpoint is committed."""
        if not self.should_save(step, last_step):
            return False
        if last_step and self.last_save_model_only:
            state = {MODEL: {k: self._exported(v) for k, v in self.states[MODEL].state_dict().items()}}
        else:
            state = self._state(self.states)
        handle = self.ckpt.save(step, state)
        if last_step or self.blocking:
            handle.wait()
        else:
            self.save_future = handle.durable
        return True

    @torch.no_grad()
    def load(self, step: int = -1) -> bool:
        """Restore ``step`` (``-1``: the newest committed one that holds the states a load restores:
        a model-only last save, ``last_save_model_only``, is passed over with a warning, where
        torchtitan's own manager would load it whole and fail); with no
        checkpoint in ``folder``, ``initial_load_path`` (a statesnap checkpoint) if given. A step-0 (seed)
        checkpoint and ``initial_load_model_only`` restore the model alone. Returns whether anything
        was loaded. Every name loaded must be in the checkpoint with its shape and dtype, and the
        checkpoint may hold no name the state lacks under the states loaded (all of them, for a
        load of the whole state)."""
        committed = self.ckpt.persistent.committed_steps()
        if step == -1 and not committed:
            if not self.initial_load_path:
                return False
            self._load_from(self.initial_load_path, model_only=self.initial_load_model_only)
            return True
        step = self._newest_resumable(committed) if step == -1 else step
        if step not in committed:
            raise CheckpointError(f"no committed checkpoint of step {step} under {self.folder} "
                                  f"(committed: {committed or 'none'})")
        self._load_from(self.ckpt.persistent.path(step), model_only=step == 0, step=step)
        return True

    def _newest_resumable(self, committed: list[int]) -> int:
        """The newest of the ``committed`` steps that holds every state its load restores."""
        passed = []  # (step, the states it lacks), newest first
        for step in reversed(committed):
            stored = ss.open(self.ckpt.persistent.path(step), storage_options=self.ckpt.config.storage_options).keys()
            lacking = parts_lacking(stored, list(self._state(self._wanted(model_only=step == 0))))
            if not lacking:
                break
            passed.append((step, lacking))
        else:
            raise CheckpointError(
                f"no committed checkpoint under {self.folder} holds every state to load: the newest, step "
                f"{passed[0][0]}, holds no {', '.join(passed[0][1])} (as a last save with last_save_model_only=True "
                "does); to load what it holds, name those in exclude_from_loading")
        for newer, lacking in passed:
            log.warning("statesnap: resuming from step %d, not from the newer step %d, which holds no %s (as a last "
                        "save with last_save_model_only=True does)", step, newer, ", ".join(lacking))
        return step

    def _wanted(self, model_only: bool) -> dict[str, Any]:
        """The states a load restores: the model alone, or all but those excluded from loading."""
        if model_only:
            return {MODEL: self.states[MODEL]}
        return {k: v for k, v in self.states.items() if k not in self.exclude_from_loading}

    def _load_from(self, path: str, model_only: bool, step: int | None = None) -> None:
        wanted = self._wanted(model_only)
        config = self.ckpt.config
        try:
            load_step(self._state(wanted), path, step, partial=len(wanted) < len(self.states),
                      storage_options=config.storage_options, process_group=config.process_group,
                      timeout_s=config.commit_timeout_s)
        except StateMismatchError as exc:
            raise exc.advised(MISMATCH_ADVICE) from None

    def wait_for_saving(self) -> None:
        """Wait until the last async save is committed; raise what failed."""
        future, self.save_future = self.save_future, None
        if future is not None:
            future.result()

    def wait_for_staging(self) -> None:
        """Wait until the snapshots in flight are copied (before anything writes the state)."""
        self.ckpt.wait_staged()

    def close(self) -> None:
        self.ckpt.close()

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _state(states: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name, value in states.items():
            if value is None:
                continue
            if name == DATALOADER:
                value = ss.PerRank(value)
            elif isinstance(value, torch.optim.Optimizer):
                value = _ThroughStateDict(value)
            out[name] = value
        return out

    def _exported(self, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != self.export_dtype:
            return value.to(self.export_dtype)
        return value


def _manager_class():
    """torchtitan's ``BaseCheckpointManager`` subclass, made when first asked for (it imports
    torchtitan)."""
    from dataclasses import dataclass
    from typing import Literal

    from torchtitan.components.checkpointer.base import BaseCheckpointManager, ModelWrapper
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import filesystem

    class StatesnapCheckpointManager(BaseCheckpointManager):
        """torchtitan's checkpoint manager backed by ``ss.Checkpointer``: set
        ``Trainer.Config.checkpoint`` to ``StatesnapCheckpointManager.Config(...)``. Its fields are
        those of torchtitan's DCP manager (``async_mode``'s pinned-memory mode is the same as
        ``async`` here: statesnap pins its arena on a GPU by itself) plus ``host_memory_gb``."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseCheckpointManager.Config):
            async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "async"
            """``disabled``: each save returns once committed; ``async``: once planned."""

            host_memory_gb: float | None = None
            """Host staging budget per rank (statesnap's default: 40% of free RAM / local ranks)."""

        def __init__(self, config: Config, *, dataloader, model_parts, optimizers, lr_schedulers,
                     states: dict[str, Any], sd_adapter=None, base_folder: str = "") -> None:
            self.enable = config.enable
            if not self.enable:
                return
            for flag in ("initial_load_in_hf", "last_save_in_hf"):
                if getattr(config, flag):
                    raise CheckpointError(
                        f"checkpoint.{flag} is not supported by the statesnap manager: convert Hugging "
                        "Face weights with ss.convert(..., source='safetensors') and load the result as "
                        "initial_load_path, and export a checkpoint with ss.export(path, dst)")
            states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                           DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
            self.checkpointer = TorchtitanCheckpointer(
                filesystem.join(base_folder, config.folder), states, interval=config.interval,
                keep_latest_k=config.keep_latest_k,
                async_mode=config.async_mode, load_only=config.load_only,
                exclude_from_loading=config.exclude_from_loading,
                enable_first_step_checkpoint=config.enable_first_step_checkpoint,
                last_save_model_only=config.last_save_model_only,
                export_dtype=TORCH_DTYPE_MAP[config.export_dtype],
                initial_load_path=config.initial_load_path,
                initial_load_model_only=config.initial_load_model_only,
                host_memory_gb=config.host_memory_gb)

        @property
        def save_future(self):
            return self.checkpointer.save_future

        def _save(self, curr_step: int, last_step: bool = False) -> bool:
            return self.checkpointer.save(curr_step, last_step)

        def _load(self, step: int = -1) -> bool:
            return self.checkpointer.load(step)

        def _maybe_wait_for_staging(self) -> None:
            self.checkpointer.wait_for_staging()

        def _wait_for_saving(self) -> None:
            self.checkpointer.wait_for_saving()

        def _close(self) -> None:
            self.checkpointer.close()

    StatesnapCheckpointManager.__module__ = StatesnapCheckpointManager.Config.__module__ = __name__
    StatesnapCheckpointManager.__qualname__ = "StatesnapCheckpointManager"
    StatesnapCheckpointManager.Config.__qualname__ = "StatesnapCheckpointManager.Config"
    return StatesnapCheckpointManager


def __getattr__(name: str):
    if name == "StatesnapCheckpointManager":
        cls = globals()[name] = _manager_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
