"""kill -9 of a training process at random moments, then a restart that must resume exactly.

A trainer (:func:`trainer`, a forked process) trains a small MLP and checkpoints every step,
either with the asynchronous ``ss.Checkpointer`` (persistent level with retention, a further
level) or with blocking ``ss.save(..., overwrite=True)`` onto one path. Before each save it
records and fsyncs the digest of the values it is saving. The bench kills it with SIGKILL a
random moment after it started training, then :func:`check` (another process) judges what the
kill left:

* every visible checkpoint (``step-N`` on either level, or ``latest``) has its manifest,
  verifies, and loads the values the trainer recorded for its step: nothing partial or torn is
  ever in view, retention and further copies included;
* the newest committed step is at least the newest the Checkpointer reported durable;
* a fresh ``Checkpointer(...).load_latest(state)`` returns that newest step, with the recorded
  values, and its start removes what the kill left behind (hidden staging and retired dirs).

The next trainer resumes from there, so one run of kills also tests resuming from a checkpoint
made by a resumed process. Where each kill landed is read from what it left: a hidden staging
directory without a manifest (flush), with one (commit), a ``.deleting-`` directory
(retention), a staging directory on the further level (further copy), a save whose snapshot was
not staged yet (save/copy), or none of these (training). For blocking saves: a staging
directory without a manifest (writing), with one (commit, or the old checkpoint being deleted
after the swap), none while a save was under way (before staging: planning, or the trainer's
fsync of its record), or no save under way (training).
"""
from __future__ import annotations

import itertools
import os
import random
import shutil
import time
from functools import partial

import statesnap as ss

from ...format.manifest import MANIFEST_NAME
from ...storage.local import RETIRED_MARK
from .checks import checkpoint_problem, level_problems, restart_problems
from .processes import ForkServer
from .report import EXPECTED, WRONG, Tally, judge, verdict
from .training import Records, Trainer, read_trail

TRAINER, CHECK = f"{__name__}:trainer", f"{__name__}:check"
ASYNC, BLOCKING = "checkpointer", "overwrite"
LATEST = "latest"
MAX_TRAIN_S = 300  # a trainer nobody kills stops by itself
READY_TIMEOUT_S = 120
CHECK_TIMEOUT_S = 120


def settings(spec: dict) -> dict:
    """The Checkpointer of a run: the same in the trainer and in the restart that checks it."""
    return {"keep_last": spec["keep_last"], "persist_every": spec["persist_every"],
            "further_root": spec["further"], "further_every": spec["further_every"], "further_keep_last": 2,
            "host_memory_gb": 0.1, "commit_timeout_s": 60}


def trainer(spec: dict) -> dict:
    """Train and checkpoint every step until killed; one that nobody kills stops after ``MAX_TRAIN_S``."""
    records = Records(spec["records"])
    train = _train_async if spec["mode"] == ASYNC else _train_blocking
    deadline = time.monotonic() + MAX_TRAIN_S
    for _ in train(spec, records):
        if time.monotonic() > deadline:
            break
    return {"outcome": WRONG, "message": f"the trainer was not killed within {MAX_TRAIN_S} s"}


def _train_async(spec: dict, records: Records):
    ckpt = ss.Checkpointer(spec["root"], **settings(spec))
    training = Trainer(ckpt.save, spec["width"], records=records)
    start = ckpt.load_latest(training.state) or 0
    records.add("ready", start)
    for step in itertools.count(start + 1):
        handle = training.step(step)
        handle.staged.add_done_callback(partial(_note, records, "staged", step))
        handle.durable.add_done_callback(partial(_note, records, "durable", step))
        yield step


def _note(records: Records, kind: str, step: int, future) -> None:
    """Record a resolved future: staged, or durable (committed, not kept in memory only)."""
    if future.exception() is None and (kind == "staged" or future.result() is not None):
        records.add(kind, step)


def _train_blocking(spec: dict, records: Records):
    path = os.path.join(spec["root"], LATEST)
    training = Trainer(lambda step, state: ss.save(state, path, overwrite=True), spec["width"], records=records)
    if os.path.exists(os.path.join(path, MANIFEST_NAME)):
        ss.load(training.state, path)
    start = training.state["extra"]["step"]
    records.add("ready", start)
    for step in itertools.count(start + 1):
        training.step(step)
        records.add("done", step)
        yield step


# --------------------------------------------------------------------------- the check after a kill

def check(spec: dict) -> dict:
    trail = read_trail(spec["records"])
    landed = _where_it_landed(spec, trail)
    problems = (_check_async if spec["mode"] == ASYNC else _check_blocking)(spec, trail)
    return verdict(problems, landed)


def _where_it_landed(spec: dict, trail) -> list[str]:
    found = set()
    if spec["mode"] == ASYNC:
        for root in filter(None, (spec["root"], spec["further"])):
            for name in os.listdir(root):
                if name.startswith(".step-") and RETIRED_MARK in name:
                    found.add("retention")
                elif name.startswith(".step-") and ".tmp-" in name:
                    committing = os.path.exists(os.path.join(root, name, MANIFEST_NAME))
                    found.add("further copy" if root == spec["further"] else "commit" if committing else "flush")
        if trail.last_hashed is not None and trail.last_hashed not in trail.staged:
            found.add("save/copy")
    else:
        staging = [n for n in os.listdir(spec["root"]) if n.startswith(f".{LATEST}.tmp-")]
        committing = any(os.path.exists(os.path.join(spec["root"], n, MANIFEST_NAME)) for n in staging)
        if staging:
            found.add("save: commit or old deleted" if committing else "save: writing")
        elif trail.last_hashed is not None and trail.last_hashed != trail.done:
            found.add("save: before staging")
    return sorted(found) or ["training"]


def _check_async(spec: dict, trail) -> list[str]:
    problems, steps = [], []
    for root in filter(None, (spec["root"], spec["further"])):
        found, step = level_problems(root, trail.hashes, spec["width"])
        problems += found
        steps += [] if step is None else [step]
    newest = max(steps, default=None)
    if trail.durable is not None and (newest is None or newest < trail.durable):
        problems.append(f"step {trail.durable} was reported durable, but the newest committed step is {newest}")
    problems += restart_problems(spec["root"], settings(spec), trail.hashes, spec["width"], newest)
    for root in filter(None, (spec["root"], spec["further"])):
        left = [n for n in os.listdir(root) if n.startswith(".step-")]
        if left:
            problems.append(f"the restart left {left} in {root}")
    return problems


def _check_blocking(spec: dict, trail) -> list[str]:
    root = spec["root"]
    visible = sorted(n for n in os.listdir(root) if not n.startswith("."))
    if visible != [LATEST]:
        return [] if not visible and trail.done is None else [f"visible entries {visible}, expected ['{LATEST}']"]
    problem, step = checkpoint_problem(os.path.join(root, LATEST), trail.hashes, spec["width"])
    if problem:
        return [problem]
    if trail.done is not None and step < trail.done:
        return [f"{LATEST} holds step {step}, but the save of step {trail.done} had returned"]
    for name in os.listdir(root):  # a blocking save leaves its staging to whoever comes next
        if name.startswith(f".{LATEST}.tmp-") and not name.endswith(".old"):
            shutil.rmtree(os.path.join(root, name))
    return []


# --------------------------------------------------------------------------- the bench side

def _run_spec(mode: str, workdir: str, index: int, rng: random.Random) -> dict:
    base = os.path.join(workdir, f"kill-{mode}-{index}")
    persist_every = rng.choice((1, 1, 2))
    spec = {"mode": mode, "root": os.path.join(base, "root"), "records": os.path.join(base, "records"),
            "width": rng.choice((64, 256, 640)), "further": None, "keep_last": rng.choice((1, 2, 3)),
            "persist_every": persist_every, "further_every": persist_every * rng.choice((1, 2, 3))}
    if mode == ASYNC:
        spec["further"] = os.path.join(base, "further")
        os.makedirs(spec["further"])
    os.makedirs(spec["root"])
    return spec


def _one_kill(server: ForkServer, spec: dict, rng: random.Random, max_delay: float) -> tuple[str, list, str]:
    """Start a trainer, SIGKILL it a random moment after it is ready, check what it left."""
    runs = read_trail(spec["records"]).runs
    child = server.start(TRAINER, spec, "trainer")
    deadline = time.monotonic() + READY_TIMEOUT_S
    while read_trail(spec["records"]).runs == runs:
        if time.monotonic() > deadline or server.wait(child, 0) is not None:
            server.reap(child)
            return WRONG, [], f"the trainer did not start training: {child.log_text(1500)}"
        time.sleep(0.01)
    time.sleep(rng.uniform(0, max_delay))
    status = server.reap(child)
    if status != -9:
        return WRONG, [], f"the trainer ended by itself ({status}) before the kill: {child.log_text(1500)}"
    return judge(*server.run(CHECK, spec, CHECK_TIMEOUT_S, "check"), CHECK_TIMEOUT_S)


def run(server: ForkServer, workdir: str, rng: random.Random, kills: dict[str, int], per_run: int,
        max_delay: float) -> list[Tally]:
    """``kills[mode]`` kills of each mode, ``per_run`` of them on one root before a fresh one."""
    tallies = []
    for mode, label in ((ASYNC, "kill -9 during async Checkpointer"), (BLOCKING, "kill -9 during ss.save overwrite")):
        tally = Tally(label)
        for index in itertools.count():
            if tally.trials >= kills[mode]:
                break
            spec = _run_spec(mode, workdir, index, rng)
            for _ in range(min(per_run, kills[mode] - tally.trials)):
                outcome, details, message = _one_kill(server, spec, rng, max_delay)
                tally.add(outcome, details, message)
                if outcome != EXPECTED:
                    break  # a fresh root for the next kill, not one already known to be broken
            shutil.rmtree(os.path.dirname(spec["root"]), ignore_errors=True)
        tallies.append(tally)
    return tallies
