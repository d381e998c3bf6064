"""Scripts that make the real libraries (DeepSpeed, megatron-core, transformers) write checkpoints,
and :func:`run_producer` to run one on N gloo ranks.

The importers are tested on files the producers wrote in the test itself, not on fixtures frozen
from another version: the on-disk layouts are the producers' private business and change between
releases (the versions are pinned in pyproject's ``producers`` extra).

Ranks start through ``torch.distributed.run --standalone``: its rendezvous binds port 0 on the
loopback and hands the port to the ranks, so there is no window between picking a free port and
binding it in which another test's processes could take it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 600


def run_producer(script: str, *args: str, nproc: int = 2, env: dict | None = None,
                 timeout_s: float = TIMEOUT_S) -> str:
    """Run ``tests/producers/<script>`` on ``nproc`` ranks; return its output, or fail with it."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               os.path.join(HERE, script), *map(str, args)]
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0",
                **(env or {})}
    done = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise AssertionError(f"producer {script} {' '.join(map(str, args))} failed with code {done.returncode}:\n"
                             f"{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return done.stdout + done.stderr


def once_each(root, make: Callable[[str, str], object]) -> Callable[[str], str]:
    """``get(name)``: the directory ``root/name``, made by ``make(name, path)`` the first time it
    is asked for (producer runs take seconds; a module's tests share them)."""
    done: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in done:
            path = os.path.join(str(root), name)
            make(name, path)
            done[name] = path
        return done[name]

    return get
