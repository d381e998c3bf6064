"""Training suite: what checkpointing costs a training run, statesnap against torch.save and DCP.

A GPT-like model (~1 GB of model + AdamW state by default) trains on the CPU (``--device cuda``:
the GPU) while each mode checkpoints every step (``--every N``: every N steps; ``--issue13``:
issue 13's smaller GPT on two threads, a checkpoint every second step). Per mode: the median
stall per checkpoint (time the training loop was blocked by it), the end-to-end time of the loop
and its overhead over the same loop without checkpoints, and peak RSS. Every measurement runs
in a fresh process (``python -m statesnap.bench.training --child ...``), and the modes are
interleaved (A B C A B C ...) over several runs whose medians are reported, because one run is
within the machine's noise.

A second part sweeps the state size (0.25, 1, 4 GB by default) for statesnap and DCP async_save:
stall and background time (from the save call until the checkpoint is durable), as a table and
a PNG under the output directory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, replace

import torch

from ..demo import gpt
from ..monitor.trace import NO_PLOT, can_plot
from .common import (
    DEFAULT_OUT, DEFAULT_THREADS, add_output_arguments, format_table, fresh_dir, median, non_negative_int,
    parse_choices, peak_rss_bytes, positive_float, positive_int, publish, remove_scratch, run_child,
)
from . import save_call
from .modes import MODES, make_mode

DEFAULT_MODES = ("none", "torch_save", "dcp_save", "dcp_async", "statesnap_p10", "statesnap_p1")
SWEEP_MODES = ("statesnap_p1", "dcp_async")
DEFAULT_BATCH = 8


# -- the child: one mode, one run --------------------------------------------------------------
def child(args: argparse.Namespace) -> dict:
    """Train ``args.steps`` steps under one checkpoint mode and return its measurements."""
    torch.set_num_threads(args.threads)
    cfg = gpt.GPTConfig(**json.loads(args.config))
    model, optimizer = gpt.build(cfg)
    model.to(args.device)  # the same Parameter objects, which the optimizer already holds
    tokens = lambda step: gpt.batch(cfg, step).to(args.device)  # noqa: E731
    gpt.train_step(model, optimizer, tokens(0))  # allocate the optimizer state
    mode = make_mode(args.mode, model, optimizer, args.scratch)
    # Warm-up steps checkpoint too, so every mode's one-time setup (statesnap's staging arena and
    # DCP's stager are allocated, and their pages first touched, at the first checkpoints) stays
    # out of the timed steps, as it does from a multi-day run's steady state.
    for step in range(1, args.warmup + 1):
        gpt.train_step(model, optimizer, tokens(step))
        if step % args.every == 0:
            mode.checkpoint(step)
    first = args.warmup + 1
    stalls = []
    started = time.perf_counter()
    for step in range(first, first + args.steps):  # statesnap persists multiples of persist_every
        gpt.train_step(model, optimizer, tokens(step))  # ends in loss.item(): a GPU step is finished
        if step % args.every == 0:
            stalls.append(mode.checkpoint(step))
    loop_s = time.perf_counter() - started
    drain_started = time.perf_counter()
    mode.finish()
    drain_s = time.perf_counter() - drain_started
    return {"mode": args.mode, "state_bytes": cfg.state_bytes(), "loop_s": loop_s, "drain_s": drain_s,
            "stalls": [s + w for s, w in zip(stalls, mode.hook_waits(len(stalls)))] if stalls else [],
            "background": mode.background_seconds()[-len(stalls):] if stalls else [], "peak_rss": peak_rss_bytes()}


def child_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="statesnap.bench.training --child")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--mode", choices=sorted(MODES), required=True)
    parser.add_argument("--config", required=True, help="GPTConfig as JSON")
    parser.add_argument("--steps", type=positive_int, required=True)
    parser.add_argument("--warmup", type=non_negative_int, default=2)
    parser.add_argument("--threads", type=positive_int, default=DEFAULT_THREADS)
    parser.add_argument("--scratch", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--every", type=positive_int, default=1)
    args = parser.parse_args(argv)
    fresh_dir(args.scratch)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that it runs without a process group: intended
            result = child(args)
    finally:
        remove_scratch(args.scratch)
    print(json.dumps(result))
    return 0


# -- the parent: interleaved runs, summaries, the size sweep -------------------------------------
@dataclass(frozen=True)
class Loop:
    """How each mode's training loop runs: timed steps, untimed warm-up steps before them (which
    checkpoint too), torch threads, device, and a checkpoint every ``every`` steps."""

    steps: int = 20
    warmup: int = 2
    threads: int = DEFAULT_THREADS
    device: str = "cpu"
    every: int = 1

    def __post_init__(self):
        if self.steps < self.every or self.warmup < 0 or self.threads < 1 or self.every < 1:
            raise ValueError(f"steps must be at least every (>= 1), threads positive, warmup not negative: {self}")

    @property
    def warmup_steps(self) -> int:
        """At least two checkpoints before the timed steps, whatever ``every``: the first ones
        carry each mode's one-time setup (see ``child``)."""
        return max(self.warmup, 2 * self.every)

    def child_args(self) -> list[str]:
        return ["--steps", str(self.steps), "--warmup", str(self.warmup_steps), "--threads", str(self.threads),
                "--device", self.device, "--every", str(self.every)]


def run_mode(mode: str, cfg: gpt.GPTConfig, loop: Loop, out: str) -> dict:
    scratch = os.path.join(out, "training-scratch")
    return run_child("statesnap.bench.training", ["--child", "--mode", mode, "--config", json.dumps(cfg.to_dict()),
                                                  "--scratch", scratch, *loop.child_args()])


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Medians per mode; overhead is relative to the median loop time without checkpoints."""
    base = median(r["loop_s"] for r in runs["none"]) if "none" in runs else None
    out = {}
    for mode, results in runs.items():
        loop = median(r["loop_s"] for r in results)
        stalls = [s for r in results for s in r["stalls"]]
        out[mode] = {"label": MODES[mode].label, "median_stall_s": median(stalls) if mode != "none" else 0.0,
                     "loop_s": loop, "drain_s": median(r["drain_s"] for r in results),
                     "overhead": loop / base - 1 if base else float("nan"),
                     "peak_rss_gb": max(r["peak_rss"] for r in results) / 1e9,
                     "loop_s_runs": [r["loop_s"] for r in results]}
    return out


def aims(summary: dict) -> list[dict]:
    """The issue's targets, checked on the measured figures."""
    checks = []
    if {"statesnap_p1", "dcp_async"} <= summary.keys():
        ratio = summary["statesnap_p1"]["median_stall_s"] / summary["dcp_async"]["median_stall_s"]
        checks.append({"what": "statesnap stall / DCP async_save stall", "value": ratio, "aim": "<= 0.1",
                       "met": ratio <= 0.1})
        ratio = summary["statesnap_p1"]["overhead"] / summary["dcp_async"]["overhead"]
        checks.append({"what": "statesnap (persist every step) overhead / DCP async_save's", "value": ratio,
                       "aim": "<= 0.5", "met": ratio <= 0.5})
    if "statesnap_p10" in summary:
        value = summary["statesnap_p10"]["overhead"]
        checks.append({"what": "statesnap (persist every 10) overhead", "value": value, "aim": "<= 0.03",
                       "met": value <= 0.03})
    return checks


def sweep(sizes: list[float], loop: Loop, out: str) -> list[dict]:
    rows = []
    for size in sizes:
        cfg = gpt.config_for_state_gb(size, batch=1)
        for mode in SWEEP_MODES:
            result = run_mode(mode, cfg, loop, out)
            rows.append({"mode": mode, "label": MODES[mode].label, "size_gb": cfg.state_bytes() / 1e9,
                         "median_stall_s": median(result["stalls"]),
                         "median_background_s": median(result["background"])})
    return rows


def plot_sweep(rows: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "median_stall_s", "stall per checkpoint"),
                           (axes[1], "median_background_s", "background time (save call -> durable)")):
        for mode in SWEEP_MODES:
            points = [(r["size_gb"], r[key]) for r in rows if r["mode"] == mode]
            ax.plot(*zip(*points), marker="o", label=MODES[mode].label)
        ax.set(xlabel="state size (GB)", ylabel="seconds", title=title, xscale="log", yscale="log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(cfg: gpt.GPTConfig, loop: Loop, runs: int = 3, modes=DEFAULT_MODES, sweep_sizes=(0.25, 1.0, 4.0),
        sweep_steps: int = 5, out: str = DEFAULT_OUT) -> dict:
    os.makedirs(out, exist_ok=True)
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(runs):  # interleaved: A B C ... A B C ...
        for mode in modes:
            results[mode].append(run_mode(mode, cfg, loop, out))
    summary = summarize(results)
    sweep_loop = replace(loop, steps=max(sweep_steps, loop.every))
    rows = sweep(list(sweep_sizes), sweep_loop, out) if sweep_sizes else []
    result = {"suite": "training", "config": cfg.to_dict(), "state_bytes": cfg.state_bytes(), "steps": loop.steps,
              "runs": runs, "threads": loop.threads, "device": loop.device, "every": loop.every,
              "summary": summary, "aims": aims(summary), "sweep": rows, "raw": results}
    if rows:
        result["plot"] = plot_sweep(rows, os.path.join(out, "training-sweep.png")) if can_plot() else \
            f"not drawn: {NO_PLOT}"
    return result


def report(result: dict) -> str:
    s = result["summary"]
    lines = [f"Training suite: GPT {result['config']} ({result['state_bytes'] / 1e9:.2f} GB model + AdamW state), "
             f"{result['threads']} torch threads, on {result.get('device', 'cpu')}, {result['steps']} steps, checkpoint every {result.get('every', 1)} step(s), "
             f"medians of {result['runs']} interleaved runs", "",
             format_table(["mode", "median stall (s)", "loop (s)", "overhead", "drain (s)", "peak RSS (GB)"],
                          [[v["label"], v["median_stall_s"], v["loop_s"], f"{100 * v['overhead']:+.1f}%",
                            v["drain_s"], v["peak_rss_gb"]] for v in s.values()])]
    if result["aims"]:
        lines += ["", format_table(["aim", "value", "target", "met"],
                                   [[a["what"], a["value"], a["aim"], "yes" if a["met"] else "NO"]
                                    for a in result["aims"]])]
    if result["sweep"]:
        lines += ["", "Stall and background time against state size", "",
                  format_table(["mode", "state (GB)", "median stall (s)", "median background (s)"],
                               [[r["label"], r["size_gb"], r["median_stall_s"], r["median_background_s"]]
                                for r in result["sweep"]]), "", f"plot: {result['plot']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--child" in argv:
        return child_main(argv)
    parser = argparse.ArgumentParser(prog="statesnap bench --suite training", description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=positive_float, default=1.0, help="model + AdamW state in GB (default 1)")
    parser.add_argument("--config", help="explicit GPTConfig as JSON (overrides --size-gb)")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per run (default 20)")
    parser.add_argument("--warmup", type=non_negative_int, default=2,
                        help="untimed steps before them (default 2; at least two checkpoints' worth)")
    parser.add_argument("--runs", type=positive_int, default=3, help="interleaved runs per mode (default 3)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated subset of " + ",".join(MODES))
    parser.add_argument("--threads", type=positive_int, default=DEFAULT_THREADS,
                        help=f"torch threads of the training (default {DEFAULT_THREADS}: the cores less one)")
    parser.add_argument("--batch", type=positive_int, default=DEFAULT_BATCH,
                        help=f"sequences per step with --size-gb (default {DEFAULT_BATCH}); more compute per step "
                             "hides more of the snapshot copy")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model trains (default cpu)")
    parser.add_argument("--every", type=positive_int, default=1, help="checkpoint every N steps (default 1)")
    parser.add_argument("--issue13", action="store_true",
                        help="issue 13's run: GPT D=768 L=8 V=8192 T=128 B=4 (0.83 GB with AdamW), 2 torch threads, "
                             "a checkpoint every 2 steps, 4 warm-up steps, no sweep")
    parser.add_argument("--sweep-gb", default="0.25,1,4", help="state sizes for the stall sweep ('' = skip)")
    parser.add_argument("--sweep-steps", type=positive_int, default=5)
    parser.add_argument("--save-call", action="store_true",
                        help="time only the ckpt.save() call (issue 13's GPT and a 1,300-tensor state), with the "
                             "state reused across saves and rebuilt at each, interleaved --runs times")
    add_output_arguments(parser)
    if "--issue13" in argv:  # issue 13's run; options given explicitly still win
        parser.set_defaults(config=json.dumps(save_call.ISSUE_GPT.to_dict()), threads=2, every=2, warmup=4,
                            sweep_gb="")
    args = parser.parse_args(argv)
    if args.save_call:
        result = save_call.run(args.steps, args.runs, args.threads, args.out)
        publish(result, "\n".join(save_call.report(result)), args.json)
        return 0
    modes = parse_choices(parser, args.modes, tuple(MODES), "modes")
    cfg = (gpt.GPTConfig(**json.loads(args.config)) if args.config
           else gpt.config_for_state_gb(args.size_gb, batch=args.batch))
    try:
        loop = Loop(args.steps, args.warmup, args.threads, args.device, args.every)
    except ValueError as exc:
        parser.error(str(exc))
    sizes = [float(x) for x in args.sweep_gb.split(",") if x]
    result = run(cfg, loop, args.runs, modes, sizes, args.sweep_steps, args.out)
    publish(result, report(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
