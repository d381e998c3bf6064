"""The ``ckpt.save()`` call alone: how long the training loop is blocked recording a snapshot.

Part of the training suite (``statesnap bench --suite training --save-call``). Two states of
issue 13: the GPT of the training run (D=768, L=8, V=8192, about 400 tensors) and 333 small
``nn.Linear`` weights (about 1,300 tensors with AdamW's moments and step counts, what one rank of
a large model holds). Each runs in a fresh process with the state reused across saves (the
default) and rebuilt at every save (``StateCache(reuse=False)``, what ``save`` did before), the
two interleaved over several runs. Between saves an optimizer step changes every tensor; each
save is waited for (durable) before the next step, so the call is timed on an idle pipeline. Per
call: wall time and the training thread's CPU time (less sensitive to other load on the machine).
Also timed: flattening the unchanged state through the cache, i.e. the change check itself.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import timeit

import torch
from torch import nn

from ..demo import gpt
from .common import fresh_dir, median, non_negative_int, positive_int, remove_scratch, run_child

STATES = ("gpt", "linear333")
ISSUE_GPT = gpt.GPTConfig(vocab=8192, d_model=768, n_layer=8, seq_len=128, batch=4)


def build_state(kind: str) -> dict:
    torch.manual_seed(0)
    if kind == "gpt":
        model, optim = gpt.build(ISSUE_GPT)
    else:
        model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(333)])
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optim": optim, "extra": {"epoch": 0}}


def optimizer_step(state: dict) -> None:
    """Every parameter gets a gradient and the optimizer changes it and its state."""
    for p in state["model"].parameters():
        p.grad = torch.ones_like(p)
    state["optim"].step()


def child(kind: str, reuse: bool, saves: int, warmup: int, threads: int, scratch: str) -> dict:
    import statesnap as ss
    from ..checkpointer.state_cache import StateCache

    torch.set_num_threads(threads)
    state = build_state(kind)
    optimizer_step(state)
    walls, cpus = [], []
    with ss.Checkpointer(scratch, keep_last=2) as ckpt:
        if not reuse:
            ckpt._state_cache = StateCache(reuse=False)
        for step in range(1, warmup + saves + 1):
            optimizer_step(state)
            state["extra"]["epoch"] = step
            wall, cpu = time.perf_counter(), time.thread_time()
            handle = ckpt.save(step, state)
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            handle.wait()
            if step > warmup:
                walls.append(wall)
                cpus.append(cpu)
        flatten = ckpt._state_cache.flatten
        check_s = min(timeit.repeat(lambda: flatten(state), number=20, repeat=5)) / 20
    tensors = len(flatten(state).tensors)
    return {"state": kind, "reuse": reuse, "tensors": tensors, "wall_s": walls, "cpu_s": cpus,
            "flatten_s": check_s}


def run(saves: int = 20, runs: int = 3, threads: int = 2, out: str = "/tmp/statesnap-bench", warmup: int = 3,
        states=STATES) -> dict:
    """Interleaved runs (reused, rebuilt, reused, ...) per state; medians over all calls."""
    raw: dict[tuple, list[dict]] = {}
    for _ in range(runs):
        for kind in states:
            for reuse in (True, False):
                raw.setdefault((kind, reuse), []).append(run_child(
                    "statesnap.bench.save_call", ["--child", kind, "--reuse" if reuse else "--no-reuse",
                                                  "--saves", str(saves), "--warmup", str(warmup),
                                                  "--threads", str(threads), "--scratch", f"{out}/save-call"]))
    rows = []
    for (kind, reuse), results in raw.items():
        walls = [w for r in results for w in r["wall_s"]]
        cpus = [c for r in results for c in r["cpu_s"]]
        rows.append({"state": kind, "reuse": reuse, "tensors": results[0]["tensors"],
                     "median_wall_ms": 1e3 * median(walls), "min_wall_ms": 1e3 * min(walls),
                     "median_cpu_ms": 1e3 * median(cpus), "flatten_ms": 1e3 * median(r["flatten_s"] for r in results)})
    return {"saves": saves, "runs": runs, "threads": threads, "rows": rows}


def report(result: dict) -> list[str]:
    from .common import format_table

    return [f"save() call, {result['saves']} saves x {result['runs']} interleaved runs, "
            f"{result['threads']} torch threads (reused: this version; rebuilt: the state flattened at every save)",
            "", format_table(["state", "tensors", "state", "median wall (ms)", "min wall (ms)", "median CPU (ms)",
                              "flatten unchanged (ms)"],
                             [[r["state"], r["tensors"], "reused" if r["reuse"] else "rebuilt", r["median_wall_ms"],
                               r["min_wall_ms"], r["median_cpu_ms"], r["flatten_ms"]] for r in result["rows"]])]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="statesnap.bench.save_call --child")
    parser.add_argument("--child", choices=STATES, required=True)
    parser.add_argument("--reuse", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--saves", type=positive_int, default=20)
    parser.add_argument("--warmup", type=non_negative_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--scratch", required=True)
    args = parser.parse_args(argv)
    fresh_dir(args.scratch)
    try:
        result = child(args.child, args.reuse, args.saves, args.warmup, args.threads, args.scratch)
    finally:
        remove_scratch(args.scratch)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
