"""Resharded load against same-layout load, against DCP, and shared reads on and off.

One job of ``--ranks`` gloo processes (4 by default) on this machine. A stack of square linear
layers plus AdamW state is saved from FSDP2 over all ranks, by statesnap and by DCP. Then each
system loads it, timed from a barrier to a barrier (the slowest rank counts), into

* ``same``: the layout that saved it;
* ``2d``: an FSDP x TP mesh (ranks/2 x 2) with ColwiseParallel/RowwiseParallel layers, so every
  rank needs parts of several stored pieces, some of them strided (FSDP over TP rows);

and, for shared reads, a replicated (DDP-style) model whose every byte every rank needs, with
``shared_reads`` off and on: from the page cache (warm), after evicting it (cold), and through
``throttled://``, the same files served like an object store (each request pays a latency, each
process has a bandwidth limit), which is where ``shared_reads=None`` shares.
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import fsspec
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem
from torch import nn

from .common import DEFAULT_OUT, drop_page_cache, format_table, fresh_dir, median, positive_float, positive_int, publish
from .job import run_job

LAYOUTS = ("same", "2d")
REMOTE = "throttled"


class ThrottledFileSystem(LocalFileSystem):
    """Local files served the way an object store serves them: every request waits ``latency_s``
    and a process's requests share ``bandwidth`` bytes/s, one after another."""

    protocol = REMOTE
    latency_s, bandwidth = 0.01, 100e6
    _lock = threading.Lock()
    _busy_until = 0.0

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return super()._strip_protocol(path[len(REMOTE) + 3:] if path.startswith(REMOTE + "://") else path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = super().cat_file(path, start=start, end=end, **kwargs)
        with ThrottledFileSystem._lock:
            begin = max(time.monotonic(), ThrottledFileSystem._busy_until)
            ThrottledFileSystem._busy_until = begin + len(data) / self.bandwidth
            done = ThrottledFileSystem._busy_until
        time.sleep(max(0.0, done - time.monotonic()) + self.latency_s)
        return data


def remote_url(path: str, mb_per_s: float, latency_ms: float) -> str:
    """``path`` behind :class:`ThrottledFileSystem` (registered in this process) with these limits."""
    ThrottledFileSystem.bandwidth, ThrottledFileSystem.latency_s = mb_per_s * 1e6, latency_ms / 1e3
    fsspec.register_implementation(REMOTE, ThrottledFileSystem, clobber=True)
    return f"{REMOTE}://{os.path.abspath(path)}"


def model_of(dim: int, layers: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(dim, dim, bias=True) for _ in range(layers)])


def laid_out(layout: str, dim: int, layers: int, world: int, seed: int):
    """(model, AdamW) in ``layout``, after one step so the optimizer has state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = model_of(dim, layers, seed)
    if layout == "same":
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "2d":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        plan = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(layers)}
        parallelize_module(model, mesh["tp"], plan)
        for layer in model:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, dim)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _barrier_timed(fn) -> float:
    dist.barrier()
    started = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - started


def _dcp_state(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def _dcp_load(model, optim, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(model, optim)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def measure(rank: int, world: int, dim: int, layers: int, repeat: int, out: str, remote_mb_per_s: float,
            remote_latency_ms: float) -> dict:
    import torch.distributed.checkpoint as dcp

    import statesnap as ss

    paths = {name: os.path.join(out, name) for name in ("statesnap", "dcp", "replicated")}
    model, optim = laid_out("same", dim, layers, world, seed=0)
    ss.save({"model": model, "optim": optim}, paths["statesnap"], overwrite=True, durable=False)
    dcp.save(_dcp_state(model, optim), checkpoint_id=paths["dcp"])
    times: dict[str, list[float]] = {}
    targets = {layout: laid_out(layout, dim, layers, world, seed=1) for layout in LAYOUTS}
    for _ in range(repeat):  # interleaved, so drifts in machine load hit every case alike
        for layout, (target, target_optim) in targets.items():
            times.setdefault(f"statesnap {layout}", []).append(_barrier_timed(
                lambda: ss.load({"model": target, "optim": target_optim}, paths["statesnap"], shared_reads=False)))
            times.setdefault(f"dcp {layout}", []).append(_barrier_timed(
                lambda: _dcp_load(target, target_optim, paths["dcp"])))
    replica, replica_optim = laid_out("plain", dim, layers, world, seed=0)
    state = {"model": replica, "optim": replica_optim}
    ss.save(state, paths["replicated"], overwrite=True, durable=False)
    sources = {"warm": paths["replicated"], "cold": paths["replicated"],
               "remote": remote_url(paths["replicated"], remote_mb_per_s, remote_latency_ms)}
    for _ in range(repeat):
        for where, source in sources.items():
            for shared in (False, True):
                if where == "cold" and rank == 0:
                    drop_page_cache([paths["replicated"]])
                times.setdefault(f"replicated {where} shared={shared}", []).append(
                    _barrier_timed(lambda: ss.load(state, source, shared_reads=shared)))
    return times


def run(dim: int = 1024, layers: int = 8, ranks: int = 4, repeat: int = 3, out: str = DEFAULT_OUT,
        remote_mb_per_s: float = 100.0, remote_latency_ms: float = 10.0) -> dict:
    """Spawn the job; return median seconds per case (slowest rank) and the ratios that matter."""
    scratch = fresh_dir(os.path.join(out, "reshard"))
    args = dict(dim=dim, layers=layers, repeat=repeat, out=scratch, remote_mb_per_s=remote_mb_per_s,
                remote_latency_ms=remote_latency_ms)
    per_rank = run_job(ranks, measure, args)
    seconds = {case: median(max(t[case][i] for t in per_rank) for i in range(repeat)) for case in per_rank[0]}
    state_bytes = layers * (dim * dim + dim) * 4 * 3
    return {
        "ranks": ranks, "dim": dim, "layers": layers, "state_bytes": state_bytes, "seconds": seconds,
        "remote": {"mb_per_s": remote_mb_per_s, "latency_ms": remote_latency_ms},
        "reshard_vs_same": seconds["statesnap 2d"] / seconds["statesnap same"],
        "reshard_vs_dcp_reshard": seconds["statesnap 2d"] / seconds["dcp 2d"],
        "same_vs_dcp_same": seconds["statesnap same"] / seconds["dcp same"],
        "shared_vs_not_warm": seconds["replicated warm shared=True"] / seconds["replicated warm shared=False"],
        "shared_vs_not_cold": seconds["replicated cold shared=True"] / seconds["replicated cold shared=False"],
        "shared_vs_not_remote": seconds["replicated remote shared=True"] / seconds["replicated remote shared=False"],
    }


def report(result: dict) -> str:
    rows = [(case, s) for case, s in result["seconds"].items()]
    ratios = [(k, v) for k, v in result.items() if k.startswith(("reshard_", "same_", "shared_"))]
    return (f"{result['ranks']} ranks, {result['layers']} layers of {result['dim']}^2 + AdamW "
            f"({result['state_bytes'] / 1e6:.0f} MB); remote: {result['remote']['mb_per_s']:g} MB/s per process, "
            f"{result['remote']['latency_ms']:g} ms per request\n" + format_table(["load", "seconds (median)"], rows) +
            "\n\n" + format_table(["ratio", "value"], ratios))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statesnap bench --suite reshard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=positive_int, default=1024, help="width of each square layer")
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--ranks", type=positive_int, default=4, help="processes (even, for the 2-D mesh)")
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--remote-mbps", type=positive_float, default=100.0,
                        help="bandwidth of each process to the simulated object store, MB/s")
    parser.add_argument("--remote-latency-ms", type=positive_float, default=10.0, help="latency of each request to it")
    parser.add_argument("--out", default=DEFAULT_OUT, help="scratch directory (checkpoints go under it)")
    parser.add_argument("--json", help="also write the figures here ('-' for stdout)")
    args = parser.parse_args(argv)
    result = run(args.dim, args.layers, args.ranks, args.repeat, args.out, args.remote_mbps, args.remote_latency_ms)
    publish(result, report(result), args.json)
    return 0
