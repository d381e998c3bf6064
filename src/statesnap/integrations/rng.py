"""Each process's random number generators as a stateful object (``ss.PerRank(RngStates())``).

Trainers save Python's, numpy's and torch's CPU generator states so that a resumed run draws
the same numbers (dropout masks, shuffles); stored as plain data, not pickle.
"""
from __future__ import annotations

import random

import numpy as np
import torch


class RngStates:
    """Python's, numpy's and torch's CPU generators, as the Trainer saves them, as plain data."""

    def state_dict(self) -> dict:
        kind, keys, position, has_gauss, gauss = np.random.get_state()
        return {"python": random.getstate(), "cpu": torch.random.get_rng_state(),
                "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss)}

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        kind, keys, position, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
        torch.random.set_rng_state(state["cpu"])
