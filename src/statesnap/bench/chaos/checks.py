"""What every scenario checks after a fault: nothing partial in view, values as recorded, a restart
that resumes from the newest committed step.

``hashes`` maps a step to the digest the trainer recorded right before saving it
(:mod:`.training`); a checkpoint is right only if it loads exactly those values. Loads go into a
model built from another seed, so a load that silently did nothing is caught too.
"""
from __future__ import annotations

import statesnap as ss

from ...checkpointer.levels import parse_step
from ...format.manifest import MANIFEST_NAME
from ...storage import backend_for, is_url
from .training import build, digest, state_of


def fresh_state(width: int, depth: int = 3) -> dict:
    model, optim = build(width, depth, seed=1)
    return state_of(model, optim, -1)


def record_problem(state: dict, hashes: dict[int, str], where: str) -> str | None:
    """None if ``state`` holds the values recorded for the step it says it is."""
    step = state["extra"]["step"]
    if step not in hashes:
        return f"{where} holds step {step}, which the trainer never recorded"
    if digest(state) != hashes[step]:
        return f"{where} holds values for step {step} that differ from the trainer's record"
    return None


def checkpoint_problem(path: str, hashes: dict[int, str], width: int, storage_options: dict | None = None,
                       depth: int = 3) -> tuple[str | None, int | None]:
    """(None, its step) if the committed checkpoint at ``path`` verifies and holds the values
    recorded for its step; else (the problem, None)."""
    try:
        ss.open(path, storage_options=storage_options).verify()
        state = fresh_state(width, depth)
        ss.load(state, path, storage_options=storage_options)
    except ss.CheckpointError as exc:
        return f"{path} does not verify or load: {exc}", None
    problem = record_problem(state, hashes, path)
    return problem, None if problem else state["extra"]["step"]


def level_problems(root: str, hashes: dict[int, str], width: int, storage_options: dict | None = None,
                   depth: int = 3) -> tuple[list[str], int | None]:
    """(problems, newest committed step) of the ``step-N`` checkpoints under ``root``. Every
    one in view must be whole. On object stores a prefix without a manifest is no checkpoint,
    but it must hold no files either: a failed save removes what it wrote."""
    backend = backend_for(root, storage_options)
    problems, newest = [], None
    for name in backend.listdir(root):
        if name.startswith(".") or name == "events":
            continue
        step, path = parse_step(name), backend.join(root, name)
        if step is None:
            problems.append(f"unexpected entry {name} in {root}")
        elif not backend.exists(backend.join(path, MANIFEST_NAME)):
            left = backend.listdir(path) if is_url(root) else ["(a directory in view)"]
            if left:
                problems.append(f"{path} has no manifest but holds {left}")
        else:
            problem, held = checkpoint_problem(path, hashes, width, storage_options, depth)
            if problem is None and held != step:
                problem = f"{path} holds step {held}"
            if problem:
                problems.append(problem)
            else:
                newest = step if newest is None else max(newest, step)
    return problems, newest


def restart_problems(root: str, settings: dict, hashes: dict[int, str], width: int, newest: int | None,
                     depth: int = 3) -> list[str]:
    """A fresh Checkpointer on ``root`` must resume from ``newest`` with its recorded values."""
    state = fresh_state(width, depth)
    try:
        with ss.Checkpointer(root, **settings) as ckpt:
            loaded = ckpt.load_latest(state)
    except ss.CheckpointError as exc:
        return [f"the restart failed: {exc}"]
    if loaded != newest:
        return [f"load_latest returned {loaded}, the newest committed step is {newest}"]
    problem = record_problem(state, hashes, f"load_latest's step {loaded}") if loaded is not None else None
    return [problem] if problem else []
