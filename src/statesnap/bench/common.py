"""Shared pieces of the benchmark suites: timing, page-cache control, peak RSS, tables, JSON, children.

Benchmarks are only worth their comparisons, so every suite measures the peers and the machine's
limits in the same run, with the same helpers, and reports medians rather than single runs.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import contextlib
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from typing import Callable, Iterable, Sequence

from ..cli import json_text

DEFAULT_OUT = "/tmp/statesnap-bench"
DROP_CACHES = "/proc/sys/vm/drop_caches"


# Training leaves one core to background work, as a GPU job leaves the host's cores to it; every
# mode runs with the same threads, so the comparison stays fair.
DEFAULT_THREADS = max(1, (os.cpu_count() or 1) - 1)


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes, from a collected heap: a full collection of the garbage earlier
    runs left (DCP's planning leaves much) took 0.12-0.17 s here, and would otherwise land in
    whichever system's sample happened to trigger it (as ``timeit`` keeps it out, by disabling
    the collector)."""
    gc.collect()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def rotated(items: Sequence, by: int) -> list:
    """``items`` starting ``by`` places further on: each repeat of a suite starts one system
    further on, so that no system always follows the same one (what ran before, on the disk or
    in the allocator, changes what a system measures)."""
    k = by % len(items) if len(items) else 0
    return [*items[k:], *items[:k]]


def release_freed_memory() -> None:
    """Hand memory that earlier runs of this process freed back to the system (glibc's
    ``malloc_trim``), so the next run allocates fresh pages as a restarted process would, rather
    than reusing faulted-in ones by the luck of the order: one ``torch.load`` of a 0.83 GB state
    into a fresh model took 0.11 to 0.45 s here depending on what the process had freed before."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in files_under(path))


def drop_page_cache(paths: Sequence[str], globally: bool = True) -> bool:
    """Evict ``paths`` from the page cache so the next read comes from the disk.

    Dirty pages cannot be evicted, so everything is synced first. ``posix_fadvise(DONTNEED)`` on
    each file works without privileges; ``/proc/sys/vm/drop_caches`` (when writable and
    ``globally``) also drops what fadvise misses, such as directory entries. Returns whether the
    global drop was done.

    On this VM the global drop slows every save that copies memory for tens of seconds after it
    (a durable save's copy into aligned buffers and direct writes: 1.2-1.4 against 1.6-1.9 GB/s,
    while writes from memory nobody touched ran at full speed), so suites that save after a cold
    load pass ``globally=False``.
    """
    os.sync()
    for path in paths:
        for name in files_under(path):
            fd = os.open(name, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    if not globally:
        return False
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def settle_disk(path: str, at_least_s: float, quiet_s: float = 1.0, timeout_s: float = 30.0) -> bool:
    """Wait at least ``at_least_s``, and until the block device under ``path`` has had no request
    in flight and completed no read, write or discard for ``quiet_s``; False after ``timeout_s``
    or where Linux's block statistics are missing.

    Deleting a file on a file system mounted with ``discard`` (this VM's root) has the disk
    discard its blocks, and this virtual disk, which behaves as if thin-provisioned, then writes
    new files at another speed. Buffered writes into a new file ran anywhere from 0.3 to 1.6 GB/s
    within a second of deleting the previous one, and at 0.3-0.5 GB/s three or six seconds later
    (direct writes: about 2 GB/s either way). Waiting gives every save the same start, the one a training job
    that deletes old checkpoints long before its next save has.
    """
    device = os.stat(path).st_dev
    sysfs = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"

    def activity():
        with open(f"{sysfs}/stat") as f:
            fields = f.read().split()
        # completed reads, writes and discards; requests in flight
        return (fields[0], fields[4], fields[11] if len(fields) > 11 else None), fields[8]

    try:
        last, _ = activity()
    except OSError:
        return False
    started = quiet_since = time.monotonic()
    while time.monotonic() < started + timeout_s:
        time.sleep(0.1)
        counters, in_flight = activity()
        if counters != last or in_flight != "0":
            last, quiet_since = counters, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s and time.monotonic() - started >= at_least_s:
            return True
    return False


def fresh_dir(path: str) -> str:
    """``path`` as an empty directory of the bench's own: what a previous run left there is
    removed, but a directory the bench did not make is refused, never removed (``--out`` may
    name a folder of the user's, with a ``convert`` folder of theirs in it). What the bench made
    is known by a hidden mark beside it that names the directory's inode (a mark inside it would
    be a stray file in the checkpoint roots the suites make there), which goes with the directory
    (``remove_scratch``): a folder the user made there later could have the same inode."""
    path = os.path.normpath(path)
    mark = _mark_of(path)
    if os.path.lexists(path):
        if not (os.path.isdir(path) and not os.path.islink(path) and (_marked(mark, path) or not os.listdir(path))):
            raise SystemExit(f"statesnap bench: {path} exists and was not made by statesnap bench, which would "
                             "remove it; pass another --out (or remove it yourself)")
        shutil.rmtree(path)
    os.makedirs(path)
    with open(mark, "w") as f:
        f.write(_inode(path))
    return path


def remove_scratch(path: str) -> None:
    """Remove a directory ``fresh_dir`` made, and its mark."""
    path = os.path.normpath(path)
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_mark_of(path))


def _mark_of(path: str) -> str:
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.statesnap-bench")


def _inode(path: str) -> str:
    made = os.stat(path)
    return f"{made.st_dev}:{made.st_ino}"


def _marked(mark: str, path: str) -> bool:
    try:
        with open(mark) as f:
            return f.read() == _inode(path)
    except OSError:
        return False


def machine_description(scratch: str) -> dict:
    """What the figures depend on: CPU, cores, memory, the disk under ``scratch``, versions."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    usage = shutil.disk_usage(scratch)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(pages * page_size / 1e9, 1),
            "scratch": scratch, "scratch_free_gb": round(usage.free / 1e9, 1),
            "python": platform.python_version(), "torch": torch.__version__,
            "kernel": platform.release()}


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table (also valid Markdown) with right-aligned numbers."""
    def cell(value) -> str:
        if isinstance(value, float):
            return "-" if value != value else f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                           for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 1) + ("-" if i == 0 else ":") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in text)])


def _number(kind: type, least: float, what: str) -> Callable[[str], float]:
    """An argparse type: a finite ``kind`` of at least ``least`` (a size of -1 GB failed deep in
    the bench with a math domain error, a repeat count of 0 printed a table of inf)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < least:
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value
    parse.__name__ = kind.__name__  # (argparse names the type in its messages)
    return parse


positive_int = _number(int, 1, "a positive integer")
non_negative_int = _number(int, 0, "a non-negative integer")
positive_float = _number(float, math.ulp(0.0), "a positive number")
non_negative_float = _number(float, 0.0, "a non-negative number")


def add_output_arguments(parser) -> None:
    """``--out`` and ``--json``, which every suite takes."""
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"scratch and output directory (default {DEFAULT_OUT})")
    parser.add_argument("--json", help="also write the results as JSON here ('-' = stdout); a non-finite figure "
                                         'is the string "nan", "inf" or "-inf"')


def parse_choices(parser, text: str, choices, what: str) -> tuple[str, ...]:
    """A comma-separated subset of ``choices``; an unknown name is a usage error."""
    chosen = tuple(name for name in text.split(",") if name)
    unknown = set(chosen) - set(choices)
    if unknown:
        parser.error(f"unknown {what} {sorted(unknown)}; choose from {', '.join(choices)}")
    return chosen


def publish(result: dict, report: str, path: str | None) -> None:
    """The report for people on stdout and, with ``--json PATH``, ``result`` as JSON there. With
    ``--json -`` stdout carries the JSON document alone (the report goes to stderr), so a script
    can parse it."""
    print(report, file=sys.stderr if path == "-" else sys.stdout)
    if path is None:
        return
    text = json_text(result)
    if path == "-":
        print(text)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def run_child(module: str, args: Sequence[str], timeout: float | None = None) -> dict:
    """Run ``python -m module args`` in a fresh process; its last stdout line is a JSON result.

    A fresh process per measurement keeps one mode's memory, threads and page cache state from
    leaking into the next one's figures (peak RSS in particular is per process).
    """
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark child {module} {' '.join(args)} failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")
    return json.loads(lines[-1])
