"""The demo's training process: resume from the latest checkpoint if any, train, snapshot every step.

It talks to the parent (``statesnap demo``) in JSON lines on stdout, one per event, flushed at
once, because the parent kills it with SIGKILL mid-run and must know how far it got.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

import statesnap as ss

from ..engine.buffers import byte_view
from . import gpt


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def digest(state: dict) -> str:
    """SHA-256 over every tensor of the model and optimizer state, in name order (bit-exact identity)."""
    h = hashlib.sha256()
    flat = {"model": state["model"].state_dict(), "optim": state["optim"].state_dict()["state"]}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            h.update(prefix.encode())
            h.update(byte_view(value.detach().contiguous()))
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(f"{prefix}.{key}", value[key])
    walk("", flat)
    return h.hexdigest()


def train(root: str, cfg: gpt.GPTConfig, steps: int, persist_every: int, keep_last: int) -> None:
    torch.set_num_threads(1)  # one thread: identical arithmetic in every run, and kind to a shared CPU
    model, optimizer = gpt.build(cfg)
    state = {"model": model, "optim": optimizer}
    ckpt = ss.Checkpointer(root, keep_last=keep_last, persist_every=persist_every)
    resumed = ckpt.load_latest(state)
    emit(event="start", resumed=resumed, level=ckpt.loaded_from)
    for step in range((resumed or 0) + 1, steps + 1):
        # Stall: what the Checkpointer blocked this step, in save() and in the optimizer's pre-step
        # hook (which waits, if at all, for the previous snapshot's copies).
        stalled_before = ckpt.stats()["stall_s"]
        loss = gpt.train_step(model, optimizer, gpt.batch(cfg, step))
        ckpt.save(step, state)
        emit(event="step", step=step, loss=loss.hex(), stall_s=ckpt.stats()["stall_s"] - stalled_before)
    ckpt.close()
    emit(event="done", digest=digest(state))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m statesnap.demo.worker")
    parser.add_argument("--root", required=True)
    parser.add_argument("--config", required=True, help="GPTConfig as JSON")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--persist-every", type=int, required=True)
    parser.add_argument("--keep-last", type=int, default=3)
    args = parser.parse_args(argv)
    train(args.root, gpt.GPTConfig(**json.loads(args.config)), args.steps, args.persist_every, args.keep_last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
