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
``register_for_checkpointing``, the gradient scaler (fp16), the gradient-accumulation counter and
each process's RNG states
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
from ..state.wrappers import PerRank
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
            "custom": {str(i): o for i, o in enumerate(acc._custom_objects)},
            "accelerator": {"step": _Counter(acc)},
            "rng": PerRank(RngStates(), on_resize="skip"),
        }
        if getattr(acc, "scaler", None) is not None:  # fp16: the loss scale, backed off at overflows
            state["scaler"] = acc.scaler
        return state

    def save(self, step: int):
        """Snapshot everything as ``step``; returns the Checkpointer's handle at once."""
        return self.ckpt.save(step, self.state())

    def load_latest(self) -> int | None:
        """Restore the newest committed step in place; return it (None: nothing saved yet). A
        checkpoint saved before the gradient scaler was saved restores the rest,
        with a warning: the scaler then starts from its initial scale."""
        state = self.state()
        try:
            return self._load_latest(state)
        except StateMismatchError as exc:
            if "scaler" not in state or not exc.missing or exc.unexpected or exc.mismatched or \
                    not all(name.startswith("scaler.") for name in exc.missing):
                raise
        log.warning("statesnap: the checkpoint holds no gradient scaler (saved before it was); restoring the rest, "
                    "the scaler starts from its initial scale")
        del state["scaler"]
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


class _Counter:
    """The accelerator's gradient-accumulation counter, saved and restored like a stateful object."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def state_dict(self) -> dict:
        return {"step": self.accelerator.step}

    def load_state_dict(self, state: dict) -> None:
        self.accelerator.step = state["step"]
