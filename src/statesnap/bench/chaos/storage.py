"""Storage that fails under the Checkpointer: a full disk, and an I/O error on the Nth read or write.

**Disk full.** A small tmpfs is mounted (this needs root and a kernel that lets it mount; CI
containers often do not) and filled with a ballast file that leaves a chosen number of bytes
free, from none to more than a checkpoint needs. Where mounting is refused, a local backend with
a byte budget raises ``ENOSPC`` once the budget is spent, as a full disk would; the report says
which ran. Step 1 is committed first, then training saves on while the disk is full.

**I/O errors.** ``faulty://`` (:mod:`statesnap.bench.faults`) over fsspec's memory or local file
system fails the Nth write (``EIO`` or ``ENOSPC``) counted from the first save after step 1, the
Nth read of a restart's ``load_latest``, or the Nth write of a blocking
``ss.save(overwrite=True)``, for every N from 1 to the number of operations a fault-free run
makes (counted first, by :func:`count`).

Expected, every time: a save that fails surfaces as a ``CheckpointError`` at the very next call
(the next ``save``, or the blocking call itself), nothing partial is visible (no ``step-N``
without its whole data, no files of the failed save left on an object store, no staging
directory left on disk), earlier checkpoints still hold their recorded values, and once space
returns (or the fault clears) the next save commits and a restart resumes from it.
"""
from __future__ import annotations

import errno as errnos
import os
import random
import shutil
import subprocess
import threading
from concurrent.futures import wait

import statesnap as ss

from ...format.manifest import MANIFEST_NAME
from ...storage import backend_for, is_url
from ...storage.base import FileWriter
from ...storage.local import LocalBackend
from ..faults import Faults
from .checks import checkpoint_problem, level_problems, record_problem, restart_problems
from .processes import ForkServer
from .report import Tally, verdict
from .training import Trainer

DISK_FULL, COUNT = f"{__name__}:disk_full", f"{__name__}:count"
WRITE_FAULT, READ_FAULT = f"{__name__}:write_fault", f"{__name__}:read_fault"
OVERWRITE_FAULT = f"{__name__}:overwrite_fault"
TMPFS, BUDGET = "tmpfs", "ENOSPC budget backend"
TMPFS_MB = 16
WIDTH = 128  # about 0.6 MB a checkpoint
FLUSH_TIMEOUT_S = 20
FAULTY_STEPS = 4  # saves while the storage fails
TRIAL_TIMEOUT_S = 60


class _BudgetWriter(FileWriter):
    def __init__(self, inner: FileWriter, take):
        self._inner, self._take = inner, take

    def pwrite(self, offset, views) -> None:
        self._take(sum(len(v) for v in views))
        self._inner.pwrite(offset, views)

    def pwrite_bulk(self, offset, view) -> None:
        self._take(len(view))
        self._inner.pwrite_bulk(offset, view)

    def bypasses_cache(self) -> bool:
        return self._inner.bypasses_cache()

    def close(self, durable: bool) -> None:
        self._inner.close(durable)


class BudgetBackend(LocalBackend):
    """Local storage with room for ``free`` more bytes (None: no limit); a write beyond fails
    with ``ENOSPC``. Only file bytes count, which is all a checkpoint's size is made of."""

    def __init__(self):
        self.free: int | None = None
        self._lock = threading.Lock()

    def _take(self, nbytes: int) -> None:
        with self._lock:
            if self.free is not None:
                if nbytes > self.free:
                    raise OSError(errnos.ENOSPC, os.strerror(errnos.ENOSPC))
                self.free -= nbytes

    def open_write(self, path: str, durable: bool = False) -> FileWriter:
        return _BudgetWriter(super().open_write(path, durable), self._take)

    def write_bytes(self, path: str, data: bytes, durable: bool, exclusive: bool = False) -> None:
        self._take(len(data))
        super().write_bytes(path, data, durable, exclusive)


class _Ballast:
    """Fills the mounted file system to leave ``free`` bytes, and empties it again."""

    def __init__(self, mount: str):
        self.path = os.path.join(mount, "ballast")

    def fill(self, free: int) -> None:
        stat = os.statvfs(os.path.dirname(self.path))
        size = max(0, stat.f_bavail * stat.f_frsize - free)
        try:
            with open(self.path, "wb", buffering=0) as f:
                chunk = bytes(1 << 20)
                while size > 0:
                    size -= f.write(chunk[:min(size, len(chunk))])
        except OSError as exc:
            if exc.errno != errnos.ENOSPC:  # asked to leave (next to) nothing free: it is full
                raise

    def release(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


def _save_onto_failing_storage(root: str, settings: dict, arm, disarm, storage_options=None) -> tuple[list, list]:
    """Commit step 1, arm the fault, train on through ``FAULTY_STEPS`` saves, check, disarm,
    commit the next step, restart. Returns (problems, details).

    A save that fails in the background must be raised by the very next call, which takes its own
    snapshot first; training goes on after it, as a loop that catches the error would."""
    problems, details = [], []
    ckpt = ss.Checkpointer(root, **settings)
    trainer = Trainer(ckpt.save, WIDTH)
    trainer.step(1).wait()
    arm()
    failed, pending = [], False
    for step in range(2, 2 + FAULTY_STEPS):
        try:
            handle = trainer.step(step)
        except ss.CheckpointError:
            details.append("raised at the next save" if pending else "raised without a failure")
            pending = False
            continue
        if pending:
            problems.append(f"the failure of step {failed[-1]} was not raised at the next save")
        if wait([handle.durable], FLUSH_TIMEOUT_S).not_done:
            return problems + [f"step {step} neither committed nor failed within {FLUSH_TIMEOUT_S} s"], details
        pending = handle.durable.exception() is not None
        failed += [step] if pending else []
        details.append("save failed" if pending else "save fit")
    found, _ = level_problems(root, trainer.hashes, WIDTH, storage_options)
    problems += found
    backend = backend_for(root, storage_options)
    problems += [f"step {s} failed but is committed" for s in failed
                 if backend.exists(backend.join(root, f"step-{s}", MANIFEST_NAME))]
    if not is_url(root):
        left = [n for n in os.listdir(root) if n.startswith(".step-")]
        problems += [f"staging not released after the failure: {left}"] if left else []
    disarm()
    last, raised = 2 + FAULTY_STEPS, []
    for step in (last, last + 1):  # (a save raising a faulty step's failure still takes its own step)
        try:
            trainer.step(step)
        except ss.CheckpointError as exc:
            raised.append(exc)
    if pending and not raised:
        problems.append(f"the failure of step {failed[-1]} was not raised at the next save")
    try:
        ckpt.close()
    except ss.CheckpointError as exc:  # (one of a faulty step that a raising save took)
        raised.append(exc)
    if not backend.exists(backend.join(root, f"step-{last + 1}", MANIFEST_NAME)):
        return problems + [f"no save succeeded once the fault cleared: {raised[-1] if raised else 'no error'}"], details
    return problems + restart_problems(root, settings, trainer.hashes, WIDTH, last + 1), details


def disk_full(spec: dict) -> dict:
    if spec["method"] == TMPFS:
        ballast, settings = _Ballast(spec["mount"]), {}
        arm, disarm = (lambda: ballast.fill(spec["free"])), ballast.release
    else:
        backend = BudgetBackend()
        settings = {"backend": backend}

        def arm():
            backend.free = spec["free"]

        def disarm():
            backend.free = None
    settings.update(keep_last=1, host_memory_gb=0.05)
    try:
        problems, details = _save_onto_failing_storage(spec["root"], settings, arm, disarm)
    finally:
        disarm()
        shutil.rmtree(spec["root"], ignore_errors=True)
    return verdict(problems, [spec["method"], *details])


def _faulty(spec: dict) -> tuple[Faults, dict]:
    """The faults of a ``faulty://`` trial and the Checkpointer settings that use them. Over a
    local file system the root is made first: the root's lease is written before anything
    else, and fsspec's local file system does not create a file's directory."""
    if spec["target"] == "file":
        os.makedirs(spec["root"][len("faulty://"):], exist_ok=True)
    faults = Faults(errno=spec.get("errno", errnos.EIO))
    options = {"faults": faults, "target_protocol": spec["target"]}
    return faults, {"keep_last": 1, "host_memory_gb": 0.05, "lease_s": 3600, "storage_options": options}


def write_fault(spec: dict) -> dict:
    faults, settings = _faulty(spec)
    problems, details = _save_onto_failing_storage(
        spec["root"], settings, lambda: faults.reset(fail_write=spec["n"]), faults.reset, settings["storage_options"])
    return verdict(problems, [spec["target"], *details])


def _holds(path: str, hashes: dict, steps: tuple, storage_options: dict) -> list[str]:
    """Problems unless ``path`` is whole and holds one of ``steps`` with its recorded values."""
    problem, held = checkpoint_problem(path, hashes, WIDTH, storage_options)
    if problem is None and held not in steps:
        problem = f"{path} holds step {held}, expected {' or '.join(map(str, steps))}"
    return [problem] if problem else []


def read_fault(spec: dict) -> dict:
    faults, settings = _faulty(spec)
    ckpt = ss.Checkpointer(spec["root"], **settings)
    trainer = Trainer(ckpt.save, WIDTH)
    for step in (1, 2):
        trainer.step(step).wait()
    ckpt.close()
    ckpt = ss.Checkpointer(spec["root"], **settings)  # a restart: its memory level is empty
    restart = Trainer(ckpt.save, WIDTH, seed=1, hashes=trainer.hashes)
    faults.reset(fail_read=spec["n"])
    problems, details = [], [spec["target"]]
    try:
        problems += _loaded(ckpt, restart, "")
        details.append("no read failed" if not faults.injected else "load survived the failed read")
    except ss.CheckpointError:
        details.append("load failed")
    faults.reset()
    try:
        problems += _loaded(ckpt, restart, "once the fault cleared, ")
        restart.step(3).wait()
        ckpt.close()
    except ss.CheckpointError as exc:
        problems.append(f"training could not continue once the fault cleared: {exc}")
    return verdict(problems, details)


def _loaded(ckpt: ss.Checkpointer, trainer: Trainer, when: str) -> list[str]:
    """Problems unless ``load_latest`` restores step 2 with its recorded values into ``trainer``."""
    loaded = ckpt.load_latest(trainer.state)
    if loaded != 2:
        return [f"{when}load_latest returned {loaded}, not 2"]
    return list(filter(None, [record_problem(trainer.state, trainer.hashes, f"{when}load_latest")]))


def overwrite_fault(spec: dict) -> dict:
    """Blocking ``ss.save(..., overwrite=True)`` failing at its Nth write: the call raises, the
    checkpoint it was replacing stays whole, no file of the failed save stays, the next
    overwrite succeeds."""
    faults, settings = _faulty(spec)
    options, path = settings["storage_options"], spec["root"] + "/latest"
    backend = backend_for(path, options)
    trainer = Trainer(lambda step, state: ss.save(state, path, overwrite=True, storage_options=options), WIDTH)
    problems, details = [], [spec["target"]]
    trainer.step(1)
    committed = set(backend.listdir(path))
    faults.reset(fail_write=spec["n"])
    try:
        trainer.step(2)
        details.append("save fit")
        allowed = (2,)
    except ss.CheckpointError:
        details.append("save failed")
        allowed = (1, 2)  # the old checkpoint, or the new one if only a step after the commit failed
    faults.reset()
    problem, held = checkpoint_problem(path, trainer.hashes, WIDTH, options)
    if problem is None and held not in allowed:
        problem = f"{path} holds step {held} after the save of step 2"
    elif problem is None and held == 1 and set(backend.listdir(path)) != committed:
        problem = f"the failed save left {sorted(set(backend.listdir(path)) - committed)}"
    problems += [problem] if problem else []
    try:
        trainer.step(3)
    except ss.CheckpointError as exc:
        return verdict(problems + [f"no save succeeded once the fault cleared: {exc}"], details)
    return verdict(problems + _holds(path, trainer.hashes, (3,), options), details)


def count(spec: dict) -> dict:
    """Reads and writes a fault-free run makes: the writes of a Checkpointer's save (after its
    first) and of a blocking overwrite, and the reads of a restart's ``load_latest``."""
    faults, settings = _faulty(spec)
    options = settings["storage_options"]
    ckpt = ss.Checkpointer(spec["root"], **settings)
    trainer = Trainer(ckpt.save, WIDTH)
    trainer.step(1).wait()
    faults.reset()
    trainer.step(2).wait()
    writes = faults.writes
    ckpt.close()
    ckpt = ss.Checkpointer(spec["root"], **settings)
    faults.reset()
    ckpt.load_latest(Trainer(ckpt.save, WIDTH).state)
    reads = faults.reads
    ckpt.close()
    ss.save(trainer.state, spec["root"] + "/latest", storage_options=options)
    faults.reset()
    ss.save(trainer.state, spec["root"] + "/latest", overwrite=True, storage_options=options)
    return {"writes": writes, "reads": reads, "overwrite_writes": faults.writes}


# --------------------------------------------------------------------------- the bench side

def _mount(path: str) -> bool:
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", path],
                              capture_output=True).returncode == 0
    except OSError:  # no mount command
        return False


def _unmount(path: str) -> None:
    if subprocess.run(["umount", path], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", path], capture_output=True)


def _spread(count_: int, top: int, rng: random.Random) -> list[int]:
    """``count_`` values of N in 1..top: all of them if there is room, else an even spread."""
    if count_ >= top:
        return list(range(1, top + 1))
    return sorted(rng.sample(range(1, top + 1), count_))


def run(server: ForkServer, workdir: str, rng: random.Random, disk_full_trials: int,
        fault_trials: int | None) -> list[Tally]:
    """``fault_trials``: how many values of N per kind of fault (None: every N)."""
    tallies = [Tally("disk full under the Checkpointer")]
    mount = os.path.join(workdir, "small-fs")
    os.makedirs(mount)
    method = TMPFS if _mount(mount) else BUDGET
    try:
        checkpoint_bytes = 12 * (WIDTH * WIDTH + WIDTH) * 3
        for i in range(disk_full_trials):
            free = (checkpoint_bytes + (256 << 10)) * i // max(1, disk_full_trials - 1)
            root = os.path.join(mount if method == TMPFS else workdir, f"disk-full-{i}")
            spec = {"root": root, "method": method, "mount": mount, "free": free}
            tallies[0].add_run(server.run(DISK_FULL, spec, TRIAL_TIMEOUT_S, "disk-full"), TRIAL_TIMEOUT_S)
    finally:
        if method == TMPFS:
            _unmount(mount)
    tallies += [Tally("I/O error on write N: Checkpointer save"), Tally("I/O error on read N: load_latest"),
                Tally("I/O error on write N: ss.save overwrite")]
    trial = 0
    for target in ("memory", "file"):
        base = f"{workdir}/faults-{target}" if target == "file" else f"chaos-{os.getpid()}-{target}"
        result, status, child = server.run(COUNT, {"root": f"faulty://{base}/count", "target": target},
                                           TRIAL_TIMEOUT_S, "count")
        if status != 0 or result is None:
            raise RuntimeError(f"counting the operations of a save failed: {child.log_text()}")
        for tally, function, top in zip(tallies[1:], (WRITE_FAULT, READ_FAULT, OVERWRITE_FAULT),
                                        (result["writes"], result["reads"], result["overwrite_writes"])):
            for n in _spread(fault_trials or top, top, rng):
                trial += 1
                spec = {"root": f"faulty://{base}/{trial}", "target": target, "n": n,
                        "errno": rng.choice((errnos.EIO, errnos.ENOSPC))}
                tally.add_run(server.run(function, spec, TRIAL_TIMEOUT_S, "fault"), TRIAL_TIMEOUT_S)
    return tallies
