"""What the framework suites share: interleaved runs of one training loop checkpointed several
ways, and the stall and overhead figures drawn from them.

Each run reports its fit time, the duration of every training step (by global step) and of every
checkpoint call (``(step, seconds)``). The stall of a checkpoint is the time the training thread
spent in the call plus what the step after it took beyond the median step of the run without
checkpoints: a lazy save (statesnap) returns at once and its update may wait for the snapshot
copy in that next step; a blocking one spends it all in the call.
"""
from __future__ import annotations

from typing import Callable

from .common import format_table, median

Run = dict  # {"fit_s": float, "steps": {step: seconds}, "saves": [(step, seconds)]}


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
    overhead = {mode: fit[mode] - fit[baseline] for mode in stall}
    return {"step_s": step_s, "fit_s": fit, "stall_s": stall, "overhead_s": overhead}


def _stall(run: Run, step_s: float) -> float:
    stalls = [seconds + max(0.0, run["steps"].get(step + 1, step_s) - step_s) for step, seconds in run["saves"]]
    return median(stalls) if stalls else 0.0


def table(summary: dict, labels: dict[str, str], default: str, ours: str = "statesnap") -> str:
    """The table and the aims line: stall and overhead of each mode, ratios to ``default``'s."""
    fit, stall, overhead = summary["fit_s"], summary["stall_s"], summary["overhead_s"]
    rows = [("no checkpoints", fit["none"], "", "", "")]
    for mode, label in labels.items():
        rows.append((label, fit[mode], f"{overhead[mode]:+.3f}", f"{stall[mode] * 1e3:.1f}",
                     f"{stall[default] / stall[mode]:.1f}x" if stall[mode] else "-"))
    return (format_table(["checkpointing", "fit (s)", "overhead (s)", "stall per checkpoint (ms)",
                          "default / this stall"], rows)
            + f"\n\nstatesnap overhead / default's: {overhead[ours] / overhead[default]:.2f} (aim <= 0.33); "
              f"stall: {stall[ours] / stall[default]:.3f} (aim <= 0.1)")
