"""Concurrency around one root: a second owner, ``save`` racing ``close``, ``load_latest`` during a flush.

* **Two owners.** A holder process owns a root with a Checkpointer and has a save in flight
  (its commit held back). A second ``Checkpointer`` on the root must raise a ``CheckpointError``
  naming the holder's pid and delete nothing (the holder's checkpoints and its staging directory
  stay). ``take_over=True`` then claims the root and commits there; the holder, let go, must
  fail its commit and raise at its next save ("taken over"), and delete none of the new owner's
  checkpoints. Every visible checkpoint holds the values its writer recorded.
* **save during close.** One thread calls ``close()`` while a flush is in flight; another calls
  ``save()`` a random moment later. The save must raise a ``CheckpointError`` or return a handle
  that resolves; ``close`` must return; nothing may hang (the trial's deadline), and a restart
  resumes from the newest committed step with its recorded values.
* **load_latest during a flush.** Right after ``save(N)`` (persisted or kept in memory only), a
  ``load_latest`` into a fresh model must return N with the values recorded for N, from memory or
  storage, and training then goes on checkpointing.
"""
from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import wait

import statesnap as ss

from ...storage.local import LocalBackend
from .checks import fresh_state, level_problems, record_problem, restart_problems
from .processes import ForkServer
from .report import EXPECTED, HANG, WRONG, Tally, verdict
from .training import Records, Trainer, read_trail

HOLDER, SECOND = f"{__name__}:holder", f"{__name__}:second_owner"
CLOSE_RACE, LOAD_DURING_FLUSH = f"{__name__}:save_during_close", f"{__name__}:load_during_flush"
WIDTH = 256
TIMEOUT_S = 60
HELD_STEP = 4  # the holder's save whose commit waits for the second owner's turn


class _HeldCommit(LocalBackend):
    """Local storage whose commit of step ``HELD_STEP`` waits until a file appears."""

    def __init__(self, go: str):
        self.go = go

    def commit(self, staging, final, *args, **kwargs) -> None:
        if final.endswith(f"step-{HELD_STEP}"):
            open(self.go + ".held", "w").close()  # the holder says it is ready only from here on
            while not os.path.exists(self.go):
                time.sleep(0.01)
        super().commit(staging, final, *args, **kwargs)


def holder(spec: dict) -> dict:
    """Own the root, commit steps 1-3, start step 4 (its commit held), say so; once let go,
    save on until a save raises."""
    records = Records(spec["records"])
    ckpt = ss.Checkpointer(spec["root"], keep_last=2, host_memory_gb=0.05, backend=_HeldCommit(spec["go"]))
    training = Trainer(ckpt.save, WIDTH, records=records)
    for step in range(1, HELD_STEP):
        training.step(step).wait()
    training.step(HELD_STEP)
    while not os.path.exists(spec["go"] + ".held"):  # its staging directory is made by then
        time.sleep(0.01)
    records.add("ready", 0)
    for step in range(HELD_STEP + 1, HELD_STEP + 50):
        try:
            training.step(step).wait()
        except ss.CheckpointError as exc:
            return {"raised": str(exc), "step": step}
    return {"raised": None}


def second_owner(spec: dict) -> dict:
    root, problems = spec["root"], []
    before = sorted(os.listdir(root))
    try:
        ss.Checkpointer(root, keep_last=1, host_memory_gb=0.05)
        problems.append("a second Checkpointer on an owned root was not refused")
    except ss.CheckpointError as exc:
        if f"pid {spec['holder_pid']}" not in str(exc):
            problems.append(f"the refusal does not name the holder (pid {spec['holder_pid']}): {exc}")
    after = sorted(os.listdir(root))
    if after != before:
        problems.append(f"the refused Checkpointer changed the root: {before} -> {after}")
    ckpt = ss.Checkpointer(root, keep_last=3, host_memory_gb=0.05, take_over=True)
    training = Trainer(ckpt.save, WIDTH)
    training.step(100).wait()
    open(spec["go"], "w").close()  # the holder may commit (and delete) now, if it still could
    deadline = time.monotonic() + TIMEOUT_S
    while not os.path.exists(spec["holder_result"]) and time.monotonic() < deadline:
        time.sleep(0.01)  # the new owner stays while the old one tries
    ckpt.close()
    return {"problems": problems, "hashes": training.hashes}


def _two_owners(server: ForkServer, workdir: str, index: int) -> tuple[str, list, str]:
    base = os.path.join(workdir, f"owners-{index}")
    spec = {name: os.path.join(base, name) for name in ("root", "records", "go")}
    os.makedirs(spec["root"])
    held = server.start(HOLDER, spec, "holder")
    deadline = time.monotonic() + TIMEOUT_S
    while not read_trail(spec["records"]).runs:
        if time.monotonic() > deadline or server.wait(held, 0) is not None:
            server.reap(held)
            return WRONG, [], f"the holder did not start: {held.log_text(1500)}"
        time.sleep(0.01)
    result, status, child = server.run(SECOND, {**spec, "holder_pid": held.pid, "holder_result": held.result},
                                       TIMEOUT_S, "second")
    if server.wait(held, TIMEOUT_S) is None:
        server.reap(held)
        return HANG, [], "the holder did not stop at a save after its root was taken over"
    if status != 0 or result is None:
        return HANG if status is None else WRONG, [], f"the second owner failed: {child.log_text(1500)}"
    problems = list(result["problems"])
    lost = held.read_result() or {}
    if not lost.get("raised") or "taken over" not in lost["raised"]:
        problems.append(f"the holder did not learn that its root was taken over: {lost or held.log_text(800)}")
    hashes = {**read_trail(spec["records"]).hashes, **{int(k): v for k, v in result["hashes"].items()}}
    found, newest = level_problems(spec["root"], hashes, WIDTH)
    problems += found
    visible = sorted(n for n in os.listdir(spec["root"]) if n.startswith("step-"))
    if newest != 100 or not {"step-2", "step-3"} <= set(visible):
        problems.append(f"checkpoints were deleted or not committed: {visible}")
    if problems:
        return WRONG, [], "; ".join(problems)
    return EXPECTED, ["refused naming the holder", "taken over", "old owner stopped"], ""


def save_during_close(spec: dict) -> dict:
    """``close()`` from another thread a random moment after ``save()`` began (while it plans,
    for a model of many small tensors), with or without an earlier save still flushing."""
    settings = {"keep_last": 2, "host_memory_gb": 0.05}
    ckpt = ss.Checkpointer(spec["root"], **settings)
    training = Trainer(ckpt.save, 16, depth=60)
    training.step(1).wait()
    if spec["in_flight"]:
        training.step(2)
    details, problems = ["with a flush in flight" if spec["in_flight"] else "idle"], []

    def close() -> None:
        time.sleep(spec["delay"])
        try:
            ckpt.close()
        except ss.CheckpointError:
            details.append("close raised")
        except Exception as exc:  # noqa: BLE001 (reported: only CheckpointError is right)
            problems.append(f"close() raised {type(exc).__name__}: {exc}")
    closing = threading.Thread(target=close)
    closing.start()
    try:
        handle = training.step(3)
        if wait([handle.durable], TIMEOUT_S / 3).not_done:
            problems.append("a save made during close never resolved")
        else:
            details.append("saved" if handle.durable.exception() is None else "save failed later")
    except ss.CheckpointError:
        details.append("refused: closed")
    closing.join(TIMEOUT_S / 3)
    if closing.is_alive():
        return verdict(problems + ["close() did not return"], details)
    found, newest = level_problems(spec["root"], training.hashes, 16, depth=60)
    return verdict(problems + found + restart_problems(spec["root"], settings, training.hashes, 16, newest, depth=60),
                   details)


def load_during_flush(spec: dict) -> dict:
    ckpt = ss.Checkpointer(spec["root"], keep_last=2, persist_every=spec["persist_every"], host_memory_gb=0.05)
    training = Trainer(ckpt.save, WIDTH)
    problems, details = [], []
    for step in range(1, 5):
        training.step(step)
        state = fresh_state(WIDTH)
        loaded = ckpt.load_latest(state)
        details.append(f"from {ckpt.loaded_from}")
        if loaded != step:
            problems.append(f"load_latest right after save({step}) returned {loaded}")
        else:
            problems += filter(None, [record_problem(state, training.hashes, f"load_latest's step {step}")])
    ckpt.close()
    found, _ = level_problems(spec["root"], training.hashes, WIDTH)
    return verdict(problems + found, details)


def run(server: ForkServer, workdir: str, rng: random.Random, owners: int, races: int) -> list[Tally]:
    tallies = [Tally("two owners of one root"), Tally("save during close"), Tally("load_latest during a flush")]
    for index in range(owners):
        tallies[0].add(*_two_owners(server, workdir, index))
    for index in range(races):
        spec = {"root": os.path.join(workdir, f"close-race-{index}"), "delay": rng.uniform(0, 0.03),
                "in_flight": rng.random() < 0.5}
        tallies[1].add_run(server.run(CLOSE_RACE, spec, TIMEOUT_S, "close-race"), TIMEOUT_S)
        spec = {"root": os.path.join(workdir, f"load-flush-{index}"), "persist_every": rng.choice((1, 2))}
        tallies[2].add_run(server.run(LOAD_DURING_FLUSH, spec, TIMEOUT_S, "load-flush"), TIMEOUT_S)
    return tallies
