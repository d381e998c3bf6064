"""Checkpoint events: one record per phase, rank and checkpoint, with bytes and wall-clock times.

Events answer "where did the time go?": the training loop only cares about the *stall* phases
(time it was blocked), while the background phases show whether persistence keeps up. The log
sums events as they come (a run checkpointing every step for days must not grow in memory) for
:meth:`EventLog.summary`, and appends them as JSON lines to a per-rank file that ``statesnap
trace`` turns into a Chrome/Perfetto trace and a PNG timeline. The file is rotated at
``MAX_FILE_BYTES`` (one previous file kept as ``.1``), so it shows the recent past, bounded.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

# Phases on the training thread: the time training is blocked by checkpointing.
STALL_PHASES = ("save", "backpressure", "wait-in-hook", "wait-staged")
# Phases in background threads. Besides these: "plan" (inside "save") and "load".
BACKGROUND_PHASES = ("copy", "checksum", "write", "fsync", "commit", "further", "arena-wait")
MAX_FILE_BYTES = 64 << 20
# The saves whose figures ``summary`` lists one by one (``stall_s_per_checkpoint``): the recent
# past; the counts and sums cover every event.
RECENT_SAVES = 10_000
log = logging.getLogger("statesnap")


def now() -> float:
    """Wall-clock seconds: comparable across ranks and processes on one machine (for traces)."""
    return time.time()


@dataclass
class Event:
    phase: str
    step: int
    rank: int
    start: float
    end: float
    nbytes: int = 0
    thread: str = ""
    info: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class CommitRecord:
    """One committed checkpoint, as ``Checkpointer(on_commit=...)`` receives it (stable fields).

    ``bytes`` and the times are this rank's: what it wrote, how long its ``save`` calls for the
    step blocked training (``stall_s``), and how long it spent checksumming, writing, syncing and
    committing in the background (``write_s``)."""

    step: int
    path: str
    rank: int
    bytes: int
    stall_s: float
    write_s: float

    @property
    def throughput_gbps(self) -> float:
        return self.bytes / self.write_s / 1e9 if self.write_s > 0 else 0.0


# Background phases whose bytes and seconds make a checkpoint's write figures.
WRITE_PHASES = ("checksum", "write", "fsync", "commit")


class EventLog:
    """Thread-safe event sink; ``path`` (a local JSON-lines file) is appended on :meth:`flush`."""

    def __init__(self, rank: int, path: str | None):
        self.rank = rank
        self.path = path
        self._phases: dict[str, dict] = {}
        # one entry per save() call, in order, of the last RECENT_SAVES; the figures by step are
        # kept for the steps in it (a run checkpointing every step for days must not grow in memory)
        self._saved_steps: deque[int] = deque()
        self._in_window: Counter = Counter()
        self._saves = 0
        self._stall_by_step: dict[int, float] = {}
        self._hook_by_step: dict[int, float] = {}
        self._writes_by_step: dict[int, list] = {}  # [seconds, bytes] until the step's commit record is taken
        self._unwritten: list[Event] = []
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()  # whole lines from concurrent flushes
        self._dropping = False  # the last write to the file failed (warned once)
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)

    def add(self, phase: str, step: int, start: float, end: float, nbytes: int = 0, **info) -> Event:
        event = Event(phase, step, self.rank, start, end, nbytes, threading.current_thread().name, info)
        with self._lock:
            agg = self._phases.setdefault(phase, {"seconds": 0.0, "bytes": 0, "count": 0})
            agg["seconds"] += event.seconds
            agg["bytes"] += nbytes
            agg["count"] += 1
            if phase in STALL_PHASES:
                self._stall_by_step[step] = self._stall_by_step.get(step, 0.0) + event.seconds
            if phase in WRITE_PHASES:
                writes = self._writes_by_step.setdefault(step, [0.0, 0])
                writes[0] += event.seconds
                writes[1] += nbytes if phase == "write" else 0
            if phase == "wait-in-hook":
                self._hook_by_step[step] = self._hook_by_step.get(step, 0.0) + event.seconds
            if phase == "save":
                self._saved(step)
            if self.path:
                self._unwritten.append(event)
        return event

    def _saved(self, step: int) -> None:
        """Count a save of ``step``; past the window, forget the oldest save's figures."""
        self._saves += 1
        self._saved_steps.append(step)
        self._in_window[step] += 1
        if len(self._saved_steps) > RECENT_SAVES:
            oldest = self._saved_steps.popleft()
            self._in_window[oldest] -= 1
            if not self._in_window[oldest]:
                del self._in_window[oldest]
                for by_step in (self._stall_by_step, self._hook_by_step, self._writes_by_step):
                    by_step.pop(oldest, None)

    def commit_record(self, step: int, path: str) -> CommitRecord:
        """The figures of the committed ``step`` (its write figures are dropped here: a run that
        checkpoints every step for days must not grow in memory)."""
        with self._lock:
            seconds, nbytes = self._writes_by_step.pop(step, (0.0, 0))
            stall = self._stall_by_step.get(step, 0.0)
        return CommitRecord(step, path, self.rank, nbytes, stall, seconds)

    @contextmanager
    def timed(self, phase: str, step: int, nbytes: int = 0, **info):
        start = now()
        try:
            yield
        finally:
            self.add(phase, step, start, now(), nbytes, **info)

    def flush(self) -> None:
        """Append the events not yet written to the events file (no-op without a file).

        The Checkpointer's background threads call this after every checkpoint, and the file
        usually sits on the disk being checkpointed to. When that disk is full, or an event holds
        a value JSON cannot, a write here must not kill the thread (every later checkpoint would
        then wait for it forever): the file is diagnostics, so the events that cannot be written
        are dropped, with one warning until a write works again, and ``summary`` still counts them."""
        with self._lock:
            batch, self._unwritten = self._unwritten, []
        if not self.path or not batch:
            return
        with self._file_lock:
            try:
                text = "".join(json.dumps(asdict(e), separators=(",", ":")) + "\n" for e in batch)
                if os.path.exists(self.path) and os.path.getsize(self.path) > MAX_FILE_BYTES:
                    os.replace(self.path, self.path + ".1")
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(text)
            except (OSError, TypeError, ValueError) as exc:  # (a value JSON cannot hold: the same)
                if not self._dropping:
                    log.warning("statesnap: cannot write events to %s (%s); dropping them until it works again",
                                self.path, exc)
                self._dropping = True
                return
            self._dropping = False

    def summary(self) -> dict:
        """Sums over all events so far; see docs/checkpointer.md for what each key means."""
        with self._lock:
            phases = {name: dict(agg) for name, agg in self._phases.items()}
            saved, saves = list(self._saved_steps), self._saves
            stall_by_step, hook_by_step = dict(self._stall_by_step), dict(self._hook_by_step)

        def total(*names):
            return sum(phases.get(n, {}).get("seconds", 0.0) for n in names)

        written = phases.get("write", {}).get("bytes", 0)
        flushing = total("checksum", "write", "fsync", "commit")
        stalls = [stall_by_step.get(s, 0.0) for s in saved]
        return {
            "checkpoints": saves,
            "stall_s": total(*STALL_PHASES),
            "stall_s_per_checkpoint": stalls,
            "stall_median_s": statistics.median(stalls) if stalls else 0.0,
            "hook_wait_s": total("wait-in-hook"),
            "hook_wait_s_per_checkpoint": [hook_by_step.get(s, 0.0) for s in saved],
            "backpressure_s": total("backpressure", "arena-wait"),
            "background_s": total(*BACKGROUND_PHASES) - total("arena-wait"),
            "bytes_staged": phases.get("copy", {}).get("bytes", 0),
            "bytes_written": written,
            "write_throughput_gbps": written / flushing / 1e9 if flushing else 0.0,
            "phases": phases,
        }
