"""Restore suite: how fast a checkpoint comes back into a fresh model and optimizer.

When a job dies, the whole job waits for the restore, so statesnap's load is measured against
what users run today, in one run, interleaved within each round (drift in the machine hits every
system alike), on the same states:

* ``torch``: ``torch.load(weights_only=True)`` + ``load_state_dict``; ``torch_mmap``: the same
  with ``mmap=True``;
* ``dcp``: ``dcp.load`` into ``get_state_dict`` of the fresh model and optimizer (which creates
  the optimizer state DCP needs, counted) + ``set_state_dict``;
* ``statesnap``: ``ss.load({"model": m, "optim": opt}, path)``;
* ``raw_parallel``: the same bytes read from one file in four streams of positioned reads straight
  into tensors, no checks: the machine's ceiling for the cold case.

States: ``gpt`` (a GPT-like model and its AdamW state, 0.83 GB), ``small`` (1,000 tensors of 1-16
KiB), ``large`` (three tensors of 400 MB). Modes: ``warm`` (files in the page cache), ``cold``
(each file evicted with ``posix_fadvise(DONTNEED)`` before the load, which needs no root, and
``/proc/sys/vm/drop_caches`` too where writable: see ``common.drop_page_cache``), ``resharded``
(a checkpoint that 2 gloo ranks wrote, each holding half of every tensor's last dimension, loaded
whole: strided pieces), and ``first_step``: a fresh process that imports, builds the model,
loads (statesnap through ``Checkpointer.load_latest``) and runs one training step, timed from
its start to its end. Every load of the first round is compared bit for bit with the source.
Each round starts one system further on, and every load goes into a target built after the
memory freed before was handed back to the system: into fresh pages, as after a restart.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

import torch
from torch import nn

from .common import (
    DEFAULT_OUT, add_output_arguments, drop_page_cache, files_under, format_table, fresh_dir, machine_description,
    median, parse_choices, positive_int, publish, release_freed_memory, remove_scratch, rotated, timed,
)

SYSTEMS = ("torch", "torch_mmap", "dcp", "statesnap", "raw_parallel")
STATES = ("gpt", "small", "large")
MODES = ("warm", "cold", "resharded", "first_step")
RESHARDED_SYSTEMS = ("dcp", "statesnap")
FIRST_STEP_SYSTEMS = ("torch", "dcp", "statesnap")
SMALL_TENSORS = 1000
# (what, statesnap's, peer's, at most): the aims, statesnap's seconds over the peer's
AIMS = (("warm", "torch", 0.7), ("warm", "dcp", 0.5), ("cold", "raw_parallel", 1 / 0.9),
        ("cold", "torch", 1.0), ("cold", "dcp", 1.0), ("first_step", "torch", 1.0), ("first_step", "dcp", 1.0))


class Bag(nn.Module):
    """Plain tensors as the parameters of a module, so every system restores them the same way."""

    def __init__(self, shapes: list[tuple], seed: int | None):
        super().__init__()
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for i, shape in enumerate(shapes):
            value = torch.randn(shape, generator=gen) if gen is not None else torch.zeros(shape)
            self.register_parameter(f"t{i:04d}", nn.Parameter(value))


def gpt_config(small: bool):
    from ..demo.gpt import config_for_state_gb

    return config_for_state_gb(0.1 if small else 0.83)


def build(state: str, small: bool, source: bool) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """The source (seeded values, AdamW state as after some steps) or a fresh target of ``state``."""
    if state == "gpt":
        from ..demo.gpt import build as build_gpt

        model, optim = build_gpt(gpt_config(small), seed=0 if source else 1)
        if source:
            gen = torch.Generator().manual_seed(2)
            for p in model.parameters():
                optim.state[p].update(step=torch.tensor(10.0), exp_avg=torch.randn(p.shape, generator=gen),
                                      exp_avg_sq=torch.rand(p.shape, generator=gen))
        return model, optim
    if state == "small":
        shapes = [(256 * (1 + i % 16),) for i in range(SMALL_TENSORS)]
    else:
        shapes = [((10 if small else 100) << 20,)] * 3  # float32: 40 MB or 400 MB each
    return Bag(shapes, seed=0 if source else None), None


def tensors_by_name(model: nn.Module, optim) -> dict[str, torch.Tensor]:
    out = dict(model.state_dict())
    if optim is not None:
        for name, p in model.named_parameters():
            for key, value in optim.state.get(p, {}).items():
                out[f"optim.{name}.{key}"] = value
    return out


def check_same(source, loaded, what: str) -> None:
    """Raise unless ``loaded`` holds every tensor of ``source`` with the same dtype, shape and bits."""
    want, got = tensors_by_name(*source), tensors_by_name(*loaded)
    if want.keys() != got.keys():
        raise AssertionError(f"{what}: loaded names differ: {sorted(want.keys() ^ got.keys())[:5]}")
    for name, a in want.items():
        b = got[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                a.reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)):
            raise AssertionError(f"{what}: {name} differs from the saved value")


def _state_dicts(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if optim is None:
        return {"model": model.state_dict()}
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


# -- one save and one load per system ------------------------------------------------------------
def save_all(model, optim, paths: dict[str, str]) -> None:
    import torch.distributed.checkpoint as dcp

    import statesnap as ss
    from .io import raw_save

    torch.save({"model": model.state_dict(), **({"optim": optim.state_dict()} if optim else {})}, paths["torch"])
    dcp.save(_state_dicts(model, optim), checkpoint_id=paths["dcp"], no_dist=True)
    ss.save(_ss_state(model, optim), paths["statesnap"], durable=False)
    raw_save(tensors_by_name(model, optim), paths["raw_parallel"], durable=False)


def _ss_state(model, optim) -> dict:
    return {"model": model} if optim is None else {"model": model, "optim": optim}


def load_torch(model, optim, path: str, mmap: bool = False) -> None:
    sd = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    model.load_state_dict(sd["model"])
    if optim is not None:
        optim.load_state_dict(sd["optim"])


def load_dcp(model, optim, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state_dicts(model, optim)
    dcp.load(state, checkpoint_id=path, no_dist=True)
    if optim is None:
        model.load_state_dict(state["model"])
    else:
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_statesnap(model, optim, path: str) -> None:
    import statesnap as ss

    ss.load(_ss_state(model, optim), path)


def load_raw_parallel(model, optim, path: str) -> None:
    from .io import raw_parallel_load

    if optim is not None:  # the raw file holds the moments too: give them somewhere to land
        for p in model.parameters():
            optim.state[p].update(step=torch.tensor(0.0), exp_avg=torch.empty_like(p), exp_avg_sq=torch.empty_like(p))
    with torch.no_grad():
        raw_parallel_load(tensors_by_name(model, optim), path)


LOAD = {"torch": load_torch, "torch_mmap": lambda m, o, p: load_torch(m, o, p, mmap=True), "dcp": load_dcp,
        "statesnap": load_statesnap, "raw_parallel": load_raw_parallel}
PATH_OF = {"torch_mmap": "torch"}


# -- resharded: a checkpoint written by 2 ranks, each with half of every tensor's last dimension ----
def _save_sharded(rank: int, world: int, state: str, small: bool, paths: dict) -> None:
    """One rank of the job that writes the resharded checkpoints (``job.run_job``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import statesnap as ss
    from ..state.flatten import flatten_for_save

    mesh = init_device_mesh("cpu", (world,))

    def shard(t):
        if not isinstance(t, torch.Tensor) or t.ndim == 0:
            return t
        return distribute_tensor(t.detach(), mesh, [Shard(t.ndim - 1)], src_data_rank=None)

    model, optim = build(state, small, source=True)
    flat = flatten_for_save(_ss_state(model, optim))
    ss.save({**{i.fqn: shard(i.local) for i in flat.tensors}, **{o.fqn: o.value for o in flat.objects}},
            paths["statesnap"], durable=False)
    dcp.save(_map_tensors(_state_dicts(model, optim), shard), checkpoint_id=paths["dcp"])


def _map_tensors(value, fn):
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    return fn(value)


def save_resharded(state: str, small: bool, paths: dict, world: int = 2) -> None:
    """Write ``state`` as ``world`` gloo ranks would, each holding a slice of every tensor's last
    dimension, for statesnap and DCP (a child's failure is raised here)."""
    from .job import run_job

    run_job(world, _save_sharded, dict(state=state, small=small, paths=paths))


# -- time to first step: a fresh process imports, builds, loads and steps -------------------------
def first_step_child(system: str, path: str, small: bool) -> dict:
    """Run in a fresh process (``--first-step``): the phases after the interpreter started."""
    started = time.perf_counter()
    from ..demo.gpt import batch, train_step
    from ..demo.gpt import build as build_gpt

    if system == "statesnap":
        import statesnap as ss
    elif system == "dcp":
        import torch.distributed.checkpoint  # noqa: F401
    imported = time.perf_counter()
    cfg = gpt_config(small)
    model, optim = build_gpt(cfg, seed=1)
    built = time.perf_counter()
    if system == "statesnap":
        ckpt = ss.Checkpointer(path)
        try:
            if ckpt.load_latest({"model": model, "optim": optim}) is None:
                raise RuntimeError(f"no checkpoint under {path}")
        finally:
            ckpt.close()
    else:
        LOAD[system](model, optim, path)
    loaded = time.perf_counter()
    train_step(model, optim, batch(cfg, 0))
    done = time.perf_counter()
    return {"import": imported - started, "build": built - imported, "load": loaded - built, "step": done - loaded}


def time_first_step(system: str, path: str, small: bool) -> tuple[float, dict]:
    """Wall seconds of a fresh process from its start to the end of its first step, and its phases."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", __name__, "--first-step", system, path,
                           *(["--small"] if small else [])], capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"first step with {system} failed:\n{proc.stderr[-4000:]}")
    return seconds, json.loads(proc.stdout.strip().splitlines()[-1])


def warm_up(path: str) -> None:
    """Read every file under ``path`` through the page cache: a cold load that read with direct
    I/O (statesnap's) leaves its files out of it, and warm loads are measured with them in."""
    for name in files_under(path):
        with open(name, "rb") as f:
            while f.read(64 << 20):
                pass


# -- the run ------------------------------------------------------------------------------------
def measure_state(state: str, small: bool, rounds: int, scratch: str, systems, modes) -> dict:
    directory = fresh_dir(os.path.join(scratch, state))
    paths = {s: os.path.join(directory, s) for s in ("torch", "dcp", "statesnap", "raw_parallel")}
    source = build(state, small, source=True)
    save_all(*source, paths)
    nbytes = sum(t.numel() * t.element_size() for t in tensors_by_name(*source).values())
    ntensors = len(tensors_by_name(*source))
    resharded = {s: os.path.join(directory, f"{s}-2ranks") for s in RESHARDED_SYSTEMS}
    if "resharded" in modes:
        save_resharded(state, small, resharded)
    first_step = state == "gpt" and "first_step" in modes
    if first_step:
        import statesnap as ss

        ckpt = ss.Checkpointer(os.path.join(directory, "statesnap-root"))
        ckpt.save(1, _ss_state(*source)).wait()
        ckpt.close()
    samples: dict[str, dict[str, list[float]]] = {}
    phases: dict[str, list[dict]] = {}
    for rnd in range(rounds):
        for mode in modes:
            for system in rotated(systems, rnd):
                if mode == "resharded" and system not in RESHARDED_SYSTEMS:
                    continue
                if mode == "first_step":
                    if not first_step or system not in FIRST_STEP_SYSTEMS:
                        continue
                    where = os.path.join(directory, "statesnap-root") if system == "statesnap" else paths[system]
                    warm_up(where)
                    seconds, parts = time_first_step(system, where, small)
                    phases.setdefault(system, []).append(parts)
                else:
                    path = (resharded if mode == "resharded" else paths)[PATH_OF.get(system, system)]
                    release_freed_memory()  # every load into fresh memory, as after a restart
                    target = build(state, small, source=False)
                    if mode == "cold":
                        drop_page_cache([path])
                    else:
                        warm_up(path)
                    seconds = timed(lambda: LOAD[system](*target, path))
                    if rnd == 0 and system != "raw_parallel":
                        check_same(source, target, f"{system} {mode} load of {state}")
                    del target
                samples.setdefault(mode, {}).setdefault(system, []).append(seconds)
    return {"bytes": nbytes, "tensors": ntensors, "seconds": samples,
            "first_step_phases": {s: {k: median(p[k] for p in ps) for k in ps[0]} for s, ps in phases.items()}}


def summarize(result: dict) -> dict:
    """Medians, spreads (min and max) and statesnap's ratios and aims per state."""
    for figures in result["states"].values():
        seconds = figures["seconds"]
        figures["median"] = {mode: {s: median(v) for s, v in per.items()} for mode, per in seconds.items()}
        figures["spread"] = {mode: {s: [min(v), max(v)] for s, v in per.items()} for mode, per in seconds.items()}
        med = figures["median"]
        figures["aims"] = [
            {"what": f"statesnap {mode} / {peer} {mode}", "ratio": med[mode]["statesnap"] / med[mode][peer],
             "at_most": bound, "met": med[mode]["statesnap"] / med[mode][peer] <= bound}
            for mode, peer, bound in AIMS if mode in med and {"statesnap", peer} <= med[mode].keys()]
        if "resharded" in med and "warm" in med and "statesnap" in med["warm"]:
            figures["aims"].append({"what": "statesnap resharded / statesnap warm", "at_most": 1.2,
                                    "ratio": med["resharded"]["statesnap"] / med["warm"]["statesnap"]})
            figures["aims"][-1]["met"] = figures["aims"][-1]["ratio"] <= 1.2
    return result


def run(small: bool = False, rounds: int = 5, out: str = DEFAULT_OUT, states=STATES, systems=SYSTEMS,
        modes=MODES) -> dict:
    scratch = fresh_dir(os.path.join(out, "restore"))
    result = {"suite": "restore", "small": small, "rounds": rounds, "machine": machine_description(out),
              "cache_drop": "posix_fadvise(DONTNEED) on every file (+ /proc/sys/vm/drop_caches where writable)",
              "states": {}}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that it runs without a process group: intended
            for state in states:
                result["states"][state] = measure_state(state, small, rounds, scratch, systems, modes)
    finally:
        remove_scratch(scratch)
    return summarize(result)


def report(result: dict) -> str:
    lines = [f"Restore suite: median seconds of {result['rounds']} interleaved rounds [min-max]; "
             f"cold = {result['cache_drop']}"]
    for state, fig in result["states"].items():
        modes = list(fig["median"])
        systems = [s for s in SYSTEMS if any(s in fig["median"][m] for m in modes)]
        def cell(m, s, fig=fig):
            if s not in fig["median"][m]:
                return "-"
            low, high = fig["spread"][m][s]
            return f"{fig['median'][m][s]:.3f} [{low:.3f}-{high:.3f}]"
        lines += ["", f"{state}: {fig['bytes'] / 1e9:.3f} GB in {fig['tensors']} tensors", "",
                  format_table(["system", *modes], [[s, *(cell(m, s) for m in modes)] for s in systems])]
        if fig["first_step_phases"]:
            phases = fig["first_step_phases"].items()
            lines += ["", "first step, phases (median s): " + "; ".join(
                f"{s}: " + ", ".join(f"{k} {v:.2f}" for k, v in p.items()) for s, p in phases)]
        if fig["aims"]:
            lines += ["", format_table(["aim (statesnap / peer, seconds)", "ratio", "at most", "met"],
                                       [[a["what"], a["ratio"], f"{a['at_most']:.2f}", "yes" if a["met"] else "NO"]
                                        for a in fig["aims"]])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statesnap bench --suite restore", description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true",
                        help="a quick run: a 0.1 GB GPT state and 40 MB large tensors")
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds; medians are reported")
    parser.add_argument("--states", default=",".join(STATES), help="comma-separated subset of " + ",".join(STATES))
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    parser.add_argument("--first-step", nargs=2, metavar=("SYSTEM", "PATH"), help=argparse.SUPPRESS)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.first_step:
        print(json.dumps(first_step_child(*args.first_step, args.small)))
        return 0
    result = run(args.small, args.rounds, args.out, parse_choices(parser, args.states, STATES, "states"),
                 parse_choices(parser, args.systems, SYSTEMS, "systems"),
                 parse_choices(parser, args.modes, MODES, "modes"))
    publish(result, report(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
