"""``statesnap trace``: turn a Checkpointer's events into a Chrome/Perfetto trace and a PNG timeline.

The Checkpointer appends its events to ``<root>/events/rank-NNNNN.jsonl``. The trace puts each
rank in its own process row and each thread (training thread, copy and write workers, flusher)
in its own lane, so a stall shows up as a bar on the training thread and the copies that caused
it as bars right above. Open the JSON in https://ui.perfetto.dev or chrome://tracing.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import sys
from dataclasses import fields

from ..errors import CheckpointError
from .events import STALL_PHASES, Event

COLORS = {"save": "#d62728", "backpressure": "#8c564b", "wait-in-hook": "#ff7f0e", "wait-staged": "#e377c2",
          "plan": "#bcbd22", "copy": "#1f77b4", "checksum": "#17becf", "write": "#2ca02c", "fsync": "#9467bd",
          "commit": "#7f7f7f", "further": "#aec7e8", "arena-wait": "#c49c94", "load": "#98df8a"}


def event_files(source: str) -> list[str]:
    """The events files of a checkpoint root, an events directory, or one file."""
    if os.path.isfile(source):
        return [source]
    for folder in (os.path.join(source, "events"), source):
        files = sorted(glob.glob(os.path.join(folder, "rank-*.jsonl")))
        if files:
            return files
    return []


# Event's field types (its annotations are strings): isinstance checks and words for messages. A
# bool, an int to Python, is refused apart.
_FIELD_TYPES = {"str": (str, "a string"), "int": (int, "an integer"), "float": ((int, float), "a finite number"),
                "dict": (dict, "a JSON object")}


def read_events(files: list[str]) -> tuple[list[dict], list[str]]:
    """All events, by start time, and where the lines that are not JSON are ("FILE, line N"):
    skipped, as a process killed mid-write leaves its last line cut short (and a restarted one
    appends after it). A line that is JSON but no event, or a file that cannot be read, raises
    a CheckpointError naming it."""
    events, skipped = [], []
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = list(f)
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                record = json.loads(line)
            except ValueError:
                skipped.append(where)
                continue
            events.append(checked_event(record, where))
    return sorted(events, key=lambda e: e["start"]), skipped


def checked_event(record, where: str) -> dict:
    """``record``, an events-file line, if it holds every field of an Event, each of its type."""
    if not isinstance(record, dict):
        raise CheckpointError(f"{where} is not a checkpoint event (a JSON object)")
    for field in fields(Event):
        kinds, kind_text = _FIELD_TYPES[field.type]
        value = record.get(field.name)
        if field.name not in record or isinstance(value, bool) or not isinstance(value, kinds) \
                or (isinstance(value, float) and not math.isfinite(value)):
            raise CheckpointError(f"{where} is not a checkpoint event: its field {field.name!r} is missing or "
                                  f"not {kind_text}")
    return record


def chrome_trace(events: list[dict]) -> dict:
    """Complete ("X") events in microseconds from the first event; one process per rank."""
    origin = min(e["start"] for e in events)
    lanes: dict[tuple[int, str], int] = {}
    trace = []
    for e in events:
        lane = lanes.setdefault((e["rank"], e["thread"]), len(lanes))
        trace.append({"name": e["phase"], "cat": "stall" if e["phase"] in STALL_PHASES else "background",
                      "ph": "X", "pid": e["rank"], "tid": lane, "ts": (e["start"] - origin) * 1e6,
                      "dur": max(e["end"] - e["start"], 0) * 1e6,
                      "args": {"step": e["step"], "bytes": e["nbytes"], **e.get("info", {})}})
    for (rank, thread), lane in lanes.items():
        trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": lane, "args": {"name": thread}})
    for rank in sorted({rank for rank, _ in lanes}):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


NO_PLOT = "matplotlib is not installed (pip install 'statesnap[plot]')"


def can_plot() -> bool:
    """matplotlib is an optional extra: plots are skipped, with :data:`NO_PLOT` said, without it."""
    return importlib.util.find_spec("matplotlib") is not None


def plot_timeline(events: list[dict], path: str) -> None:
    """One row per (rank, thread), one coloured bar per event. The bars of a row's phase are drawn
    together (one call per event made the plot quadratic in the events: minutes for a long run),
    the phases of longer events first, so that shorter ones inside them (the planning inside a
    save) are drawn over them, not hidden under them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin = min(e["start"] for e in events)
    rows = sorted({(e["rank"], e["thread"]) for e in events}, key=lambda r: (r[0], r[1] != "MainThread", r[1]))
    index = {row: i for i, row in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.35 * len(rows)))
    bars: dict[tuple, list] = {}
    for e in events:
        bars.setdefault((index[(e["rank"], e["thread"])], e["phase"]), []).append(
            (e["start"] - origin, max(e["end"] - e["start"], 1e-5)))
    for (row, phase), spans in sorted(bars.items(), key=lambda kv: -sum(w for _, w in kv[1]) / len(kv[1])):
        ax.broken_barh(spans, (row - 0.4, 0.8), color=COLORS.get(phase, "black"))
    ax.set_yticks(range(len(rows)), [f"r{rank} {thread}" for rank, thread in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title("statesnap checkpoint timeline")
    present = {e["phase"] for e in events}
    shown = [p for p in COLORS if p in present]
    ax.legend(handles=[Patch(color=COLORS[p], label=p) for p in shown], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statesnap trace", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a Checkpointer root, its events directory, or one events file")
    parser.add_argument("-o", "--output", default=None, help="trace JSON path (default: <source>/trace.json)")
    parser.add_argument("--png", default=None, help="timeline PNG path (default: next to the JSON)")
    parser.add_argument("--no-png", action="store_true", help="write only the JSON trace")
    args = parser.parse_args(argv)
    files = event_files(args.source)
    if not files:
        return _fail(f"no events files (rank-*.jsonl) under {args.source}")
    try:
        events, skipped = read_events(files)
    except CheckpointError as exc:
        return _fail(str(exc))
    if skipped:
        what = f"{len(skipped)} line(s) that are not JSON, the first in {skipped[0]}"
        if not events:
            return _fail(f"the events files under {args.source} hold no events: {what}")
        print(f"statesnap trace: skipped {what} (a process killed mid-write leaves its last line cut short)",
              file=sys.stderr)
    if not events:
        return _fail(f"the events files under {args.source} are empty")
    folder = args.source if os.path.isdir(args.source) else os.path.dirname(args.source)
    output = args.output or os.path.join(folder, "trace.json")
    try:
        with open(output, "w", encoding="utf-8") as f:
            json.dump(chrome_trace(events), f)
    except OSError as exc:
        return _fail(f"cannot write {output}: {exc.strerror or exc}")
    print(f"wrote {output} ({len(events)} events from {len(files)} rank file(s))")
    if not args.no_png:
        if not can_plot():
            print(f"statesnap trace: no PNG timeline: {NO_PLOT}; open the JSON trace in https://ui.perfetto.dev",
                  file=sys.stderr)
            return 0
        png = args.png or os.path.splitext(output)[0] + ".png"
        if not png.lower().endswith(".png"):  # (matplotlib would add it, and the name printed would be wrong)
            png += ".png"
        try:
            plot_timeline(events, png)
        except OSError as exc:
            return _fail(f"cannot write {png}: {exc.strerror or exc}")
        print(f"wrote {png}")
    return 0


def _fail(message: str) -> int:
    print(f"statesnap trace: {message}", file=sys.stderr)
    return 2  # the exit status of a command that could not do its work (cli.py)
