"""A rank that dies (SIGKILL) or stops answering (SIGSTOP) in the middle of a collective
checkpoint, on 2-4 gloo ranks: the survivors must raise a ``CheckpointError`` within the
timeout, exit normally (exit code 0, no ``terminate called`` from a C++ destructor on the
way out), and nothing partial may be visible.

Each rank is a forked process (:func:`rank`) that joins a gloo group through a store the bench
holds (``TCPStore`` on port 0: the kernel picks a free port and it stays bound). The victim
stops itself at an exact point:

* ``save``: ``ss.save`` with ``timeout_s``, as the victim enters it (``start``: before the first
  collective, which on a new process group creates statesnap's timed side group) or as it
  starts writing its file (``write``);
* ``load``: ``ss.load`` with ``timeout_s`` of a good checkpoint, as the victim enters it or as
  it starts reading (``read``);
* ``flush``: ``Checkpointer.save`` of step 2 (step 1 committed), as the victim opens its data file;
* ``commit``: the same, as rank 0, the one that commits, writes the manifest.
"""
from __future__ import annotations

import importlib
import os
import random
import shutil
import signal
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import statesnap as ss

from ...format.manifest import MANIFEST_NAME
from ...storage.local import LocalBackend
from .processes import ForkServer
from .report import EXPECTED, HANG, WRONG, Tally

RANK = f"{__name__}:rank"
STORE_TIMEOUT = timedelta(seconds=120)


def _state(rank: int, world: int) -> dict:
    return {"w": ss.Sharded(torch.full((4, 64), float(rank)), (4 * world, 64), (4 * rank, 0)),
            "b": torch.arange(8.0), "extra": {"epoch": 1}}


def _die(how: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


class _DyingBackend(LocalBackend):
    """Local storage on which this rank dies as step 2's data file is opened (``flush``) or
    its manifest written (``commit``)."""

    def __init__(self, op: str, how: str):
        self.op, self.how = op, how

    def open_write(self, path: str, durable: bool = False):
        if self.op == "flush" and f"{os.sep}.step-2.tmp-" in path:
            _die(self.how)
        return super().open_write(path, durable)

    def write_bytes(self, path: str, data: bytes, durable: bool, exclusive: bool = False) -> None:
        if self.op == "commit" and f"{os.sep}.step-2.tmp-" in path and path.endswith(MANIFEST_NAME):
            _die(self.how)
        super().write_bytes(path, data, durable, exclusive)


# (op, point) -> the function of that engine module the victim dies entering
_ENTRY = {("save", "start"): "flatten_for_save", ("save", "write"): "write_rank",
          ("load", "start"): "read_manifest", ("load", "read"): "fill_tensors"}
POINTS = {"save": ("start", "write"), "load": ("start", "read"), "flush": ("open data file",),
          "commit": ("write manifest",)}
OPS = tuple(POINTS)


def _arm(op: str, point: str, how: str) -> None:
    """Make this rank die at ``point`` of ``ss.save`` or ``ss.load``."""
    module = importlib.import_module(f"statesnap.engine.{op}")  # the package re-exports save and load
    name = _ENTRY[op, point]
    real = getattr(module, name)

    def dying(*args, **kwargs):
        _die(how)
        return real(*args, **kwargs)
    setattr(module, name, dying)


def rank(spec: dict) -> dict:
    """One rank of a trial: returns what this rank raised, and after how long."""
    torch.set_num_threads(1)
    me, world, victim, op, how = spec["rank"], spec["world"], spec["victim"], spec["op"], spec["how"]
    store = dist.TCPStore("127.0.0.1", spec["port"], world, is_master=False, timeout=STORE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=me, world_size=world)
    # A rank's init returns once its own connections are up, maybe before a peer's are: a victim
    # dying right away would fail the peer's init, which is torch's set-up, not what is tested.
    dist.barrier()
    state, path, ckpt = _state(me, world), os.path.join(spec["root"], "ckpt"), None
    # Not durable: every collective here must finish within spec["timeout"], and fsyncs on a disk
    # that another test keeps busy are what could make a healthy one late; durability is not tested.
    if op == "load":
        ss.save(state, path, durable=False)  # a good checkpoint, which the failed load must leave as it is
    elif op in ("flush", "commit"):
        backend = _DyingBackend(op, how) if me == victim else None
        ckpt = ss.Checkpointer(spec["root"], backend=backend, commit_timeout_s=spec["timeout"], host_memory_gb=0.05,
                               durable=False)
        ckpt.save(1, state).wait()
    if me == victim and op in ("save", "load"):
        _arm(op, spec["point"], how)
    started = time.monotonic()
    raised = None
    try:
        if op == "save":
            ss.save(state, path, timeout_s=spec["timeout"], durable=False)
        elif op == "load":
            ss.load(state, path, timeout_s=spec["timeout"])
        else:
            ckpt.save(2, state).wait()
    except ss.CheckpointError as exc:
        raised = exc
    seconds = time.monotonic() - started
    if ckpt is not None:
        try:
            ckpt.close()
        except ss.CheckpointError:
            pass  # the failure was raised above already, or is this one again
    dist.destroy_process_group()  # as a training script ends: the default group is the script's
    return {"raised": type(raised).__name__ if raised else None, "message": str(raised or ""), "seconds": seconds}


def _visible_problems(op: str, root: str) -> list[str]:
    """Nothing partial in view: the failed save is absent, the good checkpoints verify."""
    problems = []
    visible = sorted(n for n in os.listdir(root) if not n.startswith(".") and n != "events")
    expected = {"save": [], "load": ["ckpt"]}.get(op, ["step-1"])
    if visible != expected:
        problems.append(f"visible entries {visible}, expected {expected}")
    for name in set(visible) & set(expected):
        try:
            ss.open(os.path.join(root, name)).verify()
        except ss.CheckpointError as exc:
            problems.append(f"{name} does not verify: {exc}")
    return problems


def trial(server: ForkServer, workdir: str, world: int, op: str, point: str, victim: int, how: str,
          timeout: float) -> tuple:
    """Run one trial; return (outcome, details, message)."""
    root = tempfile.mkdtemp(prefix=f"ranks-{op}-", dir=workdir)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
    children = [server.start(RANK, {"rank": r, "world": world, "victim": victim, "op": op, "point": point,
                                    "how": how, "port": store.port, "root": root, "timeout": timeout}, f"rank{r}",
                             shutdown=True)
                for r in range(world)]
    bound = 3 * timeout + 10  # the collective that waits for the victim times out once; slack for a busy machine
    survivors = [c for r, c in enumerate(children) if r != victim]
    deadline = time.monotonic() + bound + 60
    statuses = [server.wait(c, max(0.0, deadline - time.monotonic())) for c in survivors]
    victim_status = server.reap(children[victim])
    problems, details = [], []
    if None in statuses:
        for child, status in zip(survivors, statuses):
            if status is None:
                server.reap(child)
        stuck = survivors[statuses.index(None)]
        return HANG, [], f"a survivor still ran {bound + 60:g} s later: {stuck.log_text(1500)}"
    if how == "kill" and victim_status != -signal.SIGKILL:
        problems.append(f"the victim did not die at its point (status {victim_status}): "
                        f"{children[victim].log_text(800)}")
    for child, status in zip(survivors, statuses):
        result, log = child.read_result(), child.log_text()
        if status != 0 or result is None:
            problems.append(f"a survivor exited with {status}: {log[-1500:]}")
        elif result["raised"] is None:
            problems.append("a survivor raised nothing")
        elif result["seconds"] > bound:
            problems.append(f"a survivor raised only after {result['seconds']:.1f} s: {result['message']}")
        else:
            details.append("named the rank" if f"rank {victim}" in result["message"] else "did not name the rank")
        if "terminate called" in log:
            problems.append(f"a survivor's exit printed 'terminate called': {log[-800:]}")
    problems += _visible_problems(op, root)
    shutil.rmtree(root, ignore_errors=True)
    return (WRONG if problems else EXPECTED), details, "; ".join(problems)


def run(server: ForkServer, workdir: str, rng: random.Random, trials: list[tuple[int, str, str]],
        timeout: float) -> list[Tally]:
    """``trials``: (world size, op, how) each; the point is a random one of the op's, the victim a
    random rank (rank 0 for a commit)."""
    tallies = {op: Tally(f"rank dies during {op}") for op in OPS}
    for world, op, how in trials:
        point, victim = rng.choice(POINTS[op]), 0 if op == "commit" else rng.randrange(world)
        outcome, details, message = trial(server, workdir, world, op, point, victim, how, timeout)
        tallies[op].add(outcome, [f"{world} ranks", f"victim rank {'0' if victim == 0 else 'n>0'}", point,
                                  f"SIG{'KILL' if how == 'kill' else 'STOP'}", *details], message)
    return [tallies[op] for op in OPS if tallies[op].trials]
