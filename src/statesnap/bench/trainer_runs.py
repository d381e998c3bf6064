"""What the framework suites share: interleaved runs of one training loop checkpointed several
ways, and the stall and overhead figures drawn from them.

Each run reports its fit time, the duration of every training step (by global step) and of every
checkpoint call (``(step, seconds)``), and statesnap's runs how long optimizer steps waited for
snapshot copies in all. Two figures per checkpoint:

* blocked: the time the training thread could not go on, the call plus (statesnap) the
  optimizer's mean wait for the copy per checkpoint; a blocking save spends it all in the call;
* stall: the call plus what the step after it took beyond the median step of the run without
  checkpoints. Besides the wait, this counts the slowdown of that step by the background copy
  and write running on the same cores (all of them, when the trainer uses every core as here).
"""
from __future__ import annotations

import argparse
from typing import Callable

from .common import DEFAULT_THREADS, add_output_arguments, format_table, median, positive_int

Run = dict  # {"fit_s": float, "steps": {step: seconds}, "saves": [(step, seconds)], "optimizer_wait_s": float}


def add_run_arguments(parser: argparse.ArgumentParser, durable_help: str) -> None:
    """The options every framework suite takes after its model's: rounds, durability, threads, output."""
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--no-durable", dest="durable", action="store_false", help=durable_help)
    parser.add_argument("--threads", type=positive_int, default=DEFAULT_THREADS,
                        help=f"torch threads of the training (default {DEFAULT_THREADS}: the cores less one, as in "
                             "the training suite)")
    add_output_arguments(parser)


def optimizer_wait_s(checkpointers) -> float:
    """How long the optimizer steps waited for these Checkpointers' snapshot copies, in all."""
    return sum(ckpt.stats()["hook_wait_s"] for ckpt in checkpointers)


def interleaved(modes: tuple[str, ...], run_one: Callable[[str], Run], repeat: int) -> dict[str, list[Run]]:
    """``repeat`` rounds of every mode in turn, after one warm-up run of the first (imports,
    allocator, page cache), so that drifts in the machine's load hit every mode alike."""
    run_one(modes[0])
    runs: dict[str, list[Run]] = {mode: [] for mode in modes}
    for _ in range(repeat):
        for mode in modes:
            runs[mode].append(run_one(mode))
    return runs


def summarize(runs: dict[str, list[Run]], baseline: str = "none") -> dict:
    """Medians: fit time per mode, and stall per checkpoint and overhead against ``baseline``."""
    step_s = median(s for r in runs[baseline] for s in r["steps"].values())
    fit = {mode: median(r["fit_s"] for r in rs) for mode, rs in runs.items()}
    stall = {mode: median(_stall(r, step_s) for r in rs) for mode, rs in runs.items() if mode != baseline}
    blocked = {mode: median(_blocked(r) for r in rs) for mode, rs in runs.items() if mode != baseline}
    overhead = {mode: fit[mode] - fit[baseline] for mode in stall}
    return {"step_s": step_s, "fit_s": fit, "blocked_s": blocked, "stall_s": stall, "overhead_s": overhead}


def _blocked(run: Run) -> float:
    calls = [seconds for _, seconds in run["saves"]]
    return median(calls) + run.get("optimizer_wait_s", 0.0) / len(calls) if calls else 0.0


def _stall(run: Run, step_s: float) -> float:
    stalls = [seconds + max(0.0, run["steps"].get(step + 1, step_s) - step_s) for step, seconds in run["saves"]]
    return median(stalls) if stalls else 0.0


def table(summary: dict, labels: dict[str, str], default: str, ours: str = "statesnap") -> str:
    """The table and the aims line: stall and overhead of each mode, ratios to ``default``'s."""
    fit, stall, overhead = summary["fit_s"], summary["stall_s"], summary["overhead_s"]
    blocked = summary["blocked_s"]
    rows = [("no checkpoints", fit["none"], "", "", "", "")]
    for mode, label in labels.items():
        rows.append((label, fit[mode], f"{overhead[mode]:+.3f}", f"{blocked[mode] * 1e3:.1f}",
                     f"{stall[mode] * 1e3:.1f}", f"{stall[default] / stall[mode]:.1f}x" if stall[mode] else "-"))
    return (format_table(["checkpointing", "fit (s)", "overhead (s)", "blocked per checkpoint (ms)",
                          "stall per checkpoint (ms)", "default / this stall"], rows)
            + f"\n\nstatesnap overhead / default's: {overhead[ours] / overhead[default]:.2f} (aim <= 0.33); "
              f"stall: {stall[ours] / stall[default]:.3f}, blocked: {blocked[ours] / blocked[default]:.3f} "
              "(aim <= 0.1)")
