"""``statesnap demo``: train, get killed, resume, and show that nothing was lost.

A small GPT trains on the CPU in a child process with an ``ss.Checkpointer`` snapshot after every
step (persisted every few steps). The demo SIGKILLs the child mid-run, as a crash or a preempted
node would, starts it again, and the restart resumes from the newest committed checkpoint. A
third, uninterrupted run of the same training is the reference: the resumed run's losses and its
final model + optimizer state must equal it bit for bit.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from .gpt import GPTConfig

DEMO_CONFIG = GPTConfig(vocab=512, d_model=128, n_layer=2, seq_len=64, batch=8)


@dataclass
class Run:
    """What one training process reported: the step it resumed from, per-step losses and stalls."""

    resumed: int | None = None
    level: str | None = None  # the Checkpointer level it resumed from
    losses: dict[int, str] = field(default_factory=dict)  # step -> float.hex(loss), exact
    stalls: dict[int, float] = field(default_factory=dict)
    digest: str | None = None
    killed_after: int | None = None


@dataclass
class DemoResult:
    interrupted: Run
    resumed: Run
    reference: Run

    @property
    def losses_match(self) -> bool:
        steps = self.resumed.losses.keys()
        return bool(steps) and all(self.resumed.losses[s] == self.reference.losses[s] for s in steps)

    @property
    def state_matches(self) -> bool:
        return self.resumed.digest is not None and self.resumed.digest == self.reference.digest

    @property
    def ok(self) -> bool:
        return self.losses_match and self.state_matches


def _print_step(step: int, loss_hex: str, stall: float) -> None:
    print(f"  step {step:3d}  loss {float.fromhex(loss_hex):.4f}  stall {1e3 * stall:6.2f} ms", flush=True)


def train_process(root: str, cfg: GPTConfig, steps: int, persist_every: int, kill_after: int | None = None,
                  echo: bool = True) -> Run:
    """Run the worker; with ``kill_after``, SIGKILL it as soon as it reports that step."""
    cmd = [sys.executable, "-m", "statesnap.demo.worker", "--root", root, "--config", json.dumps(cfg.to_dict()),
           "--steps", str(steps), "--persist-every", str(persist_every)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    run = Run()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        for line in proc.stdout:
            event = json.loads(line)
            if event["event"] == "start":
                run.resumed, run.level = event["resumed"], event["level"]
            elif event["event"] == "step":
                run.losses[event["step"]] = event["loss"]
                run.stalls[event["step"]] = event["stall_s"]
                if echo:
                    _print_step(event["step"], event["loss"], event["stall_s"])
                if kill_after is not None and event["step"] >= kill_after:
                    proc.send_signal(signal.SIGKILL)
                    run.killed_after = event["step"]
                    break
            elif event["event"] == "done":
                run.digest = event["digest"]
        errors = proc.stderr.read()
        code = proc.wait()
    if run.killed_after is None and code != 0:
        raise RuntimeError(f"demo training process failed (exit {code}):\n{errors[-4000:]}")
    return run


def run_demo(root: str, steps: int = 40, kill_after: int = 23, persist_every: int = 5,
             cfg: GPTConfig = DEMO_CONFIG, echo: bool = True) -> DemoResult:
    """Interrupted run + restart under ``root``/run, uninterrupted reference under ``root``/reference."""
    say = print if echo else (lambda *a, **k: None)
    run_root, ref_root = os.path.join(root, "run"), os.path.join(root, "reference")
    say(f"[1] training, to be killed after step {kill_after} (checkpoints in {run_root})")
    interrupted = train_process(run_root, cfg, steps, persist_every, kill_after, echo)
    say(f"  *** SIGKILL after step {interrupted.killed_after}: host-memory snapshots die with the process ***\n")
    say("[2] restarting the same command")
    resumed = train_process(run_root, cfg, steps, persist_every, None, False)
    say(f"  resumed from the newest committed checkpoint: step {resumed.resumed}, {resumed.level} level "
        f"({os.path.join(run_root, f'step-{resumed.resumed}')})")
    for step in sorted(resumed.losses):
        if echo:
            _print_step(step, resumed.losses[step], resumed.stalls[step])
    say("\n[3] an uninterrupted run of the same training, for reference")
    reference = train_process(ref_root, cfg, steps, persist_every, None, False)
    return DemoResult(interrupted, resumed, reference)


def summary(result: DemoResult, persist_every: int) -> str:
    stalls = sorted(s for run in (result.interrupted, result.resumed) for s in run.stalls.values())
    steps = sorted(result.resumed.losses)
    redone = [s for s in result.interrupted.losses if s in result.resumed.losses]
    yes = lambda ok: "yes" if ok else "NO"  # noqa: E731
    resumed_line = (f"  killed after step {result.interrupted.killed_after}; resumed from step "
                    f"{result.resumed.resumed} (persisted every {persist_every} steps)")
    if redone:
        resumed_line += f", so steps {redone[0]}..{redone[-1]} were trained again"
    return "\n".join([
        "", "summary", resumed_line,
        f"  losses of steps {steps[0]}..{steps[-1]} equal the uninterrupted run's bit for bit: "
        f"{yes(result.losses_match)}",
        f"  final model + AdamW state equals the uninterrupted run's bit for bit: {yes(result.state_matches)}",
        f"  stall per checkpoint: median {1e3 * stalls[len(stalls) // 2]:.2f} ms, max {1e3 * stalls[-1]:.2f} ms "
        f"over {len(stalls)} checkpoints",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statesnap demo", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--kill-after", type=int, default=23, help="SIGKILL the first run after this step (default 23)")
    parser.add_argument("--persist-every", type=int, default=5, help="persist every N-th snapshot (default 5)")
    parser.add_argument("--root", help="where checkpoints go (default: a new temporary directory, removed after)")
    args = parser.parse_args(argv)
    if not 0 < args.kill_after < args.steps:
        parser.error("--kill-after must be between 1 and --steps - 1")
    if args.persist_every < 1:
        parser.error("--persist-every must be at least 1")
    if args.root is not None:
        _check_root(parser, args.root)
    root = args.root or tempfile.mkdtemp(prefix="statesnap-demo-")
    cfg = DEMO_CONFIG
    print(f"statesnap demo: a GPT with {cfg.n_params() / 1e6:.2f}M parameters "
          f"({cfg.state_bytes() / 1e6:.1f} MB of model + AdamW state) trains for {args.steps} steps on the CPU,\n"
          f"a snapshot after every step, persisted to disk every {args.persist_every} steps.\n")
    try:
        result = run_demo(root, args.steps, args.kill_after, args.persist_every, cfg)
    except RuntimeError as exc:  # a training process failed: its own error is on stderr above
        print(f"statesnap demo: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    print(summary(result, args.persist_every))
    return 0 if result.ok else 1


def _check_root(parser: argparse.ArgumentParser, root: str) -> None:
    """A ``--root`` the demo can use: a directory (or none yet) without an earlier demo's
    checkpoints, from which the run to be killed would resume instead of training."""
    if os.path.exists(root) and not os.path.isdir(root):
        parser.error(f"--root {root} is not a directory")
    used = [name for name in ("run", "reference") if os.path.isdir(os.path.join(root, name))
            and os.listdir(os.path.join(root, name))]
    if used:
        parser.error(f"--root {root} already holds an earlier demo's checkpoints ({', '.join(used)}/), from which "
                     "this one would resume instead of training: choose a new --root, or remove them")
