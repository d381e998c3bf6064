"""Each process's random number generators as a stateful object (``ss.PerRank(RngStates())``).

Trainers save Python's, numpy's, torch's CPU and CUDA generator states so that a resumed run
draws the same numbers (dropout masks, shuffles); stored as plain data, not pickle.
"""
from __future__ import annotations

import random

import numpy as np
import torch


class RngStates:
    """Python's, numpy's, torch's CPU and CUDA generators, as the Trainer saves them, as plain data.

    CUDA's are every visible device's (``torch.cuda.get_rng_state_all``), as the Trainer and
    accelerate keep them: dropout on a GPU draws from them, so a resumed run without them drew
    other masks than the run it continues. Saved only where CUDA is initialized already: asking
    for them initializes it, which a save must not do to a process that has not used the GPU
    (its generators are then as seeded, with nothing drawn). A checkpoint saved without them
    leaves them as they are; one saved with more devices than are visible restores those there are."""

    def state_dict(self) -> dict:
        kind, keys, position, has_gauss, gauss = np.random.get_state()
        state = {"python": random.getstate(), "cpu": torch.random.get_rng_state(),
                 "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss)}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        kind, keys, position, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
        torch.random.set_rng_state(state["cpu"])
        if state.get("cuda") and torch.cuda.is_available():
            for device, cuda in zip(range(torch.cuda.device_count()), state["cuda"]):
                torch.cuda.set_rng_state(cuda, device)
