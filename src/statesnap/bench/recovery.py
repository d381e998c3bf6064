"""Recovery after a node loss: from the partner's peer replica against from ``root``.

One job of ``--ranks`` gloo processes (4 by default) on this machine, simulating two nodes (the
first half of the ranks on node 0), each with its own node-local directory. Every rank holds
``--mb-per-rank`` of sharded fp32 state. One step is saved with ``peer_replicas=1`` to the
node-local levels and to ``root``, which is ``throttled://``: the same files served like an object
store (each request pays ``--remote-latency-ms``, each process reads at ``--remote-mbps``). The
node-local levels are directories on this machine's disk (``--local disk``) or in its shared
memory (``--local shm``: ``shm://`` roots, a tmpfs, as a node keeps them in RAM). Then,
``--repeat`` times, node 1's level is wiped and a restarted job's ``load_latest`` is timed, from a
barrier to a barrier (the slowest rank counts):

* ``peer``: with the node-local level: node 1 fetches its ranks' files from node 0 over the
  checkpointer's gloo group, then every rank loads from its own node;
* ``root``: a job with no node-local level, which reads everything from ``root``.

Every load is compared bit for bit with the saved values.
"""
from __future__ import annotations

import argparse
import os
import shutil
import uuid

import torch
import torch.distributed as dist

from .common import (
    DEFAULT_OUT, add_output_arguments, format_table, fresh_dir, median, positive_float, positive_int, publish,
    remove_scratch,
)
from .job import run_job
from .reshard import _barrier_timed, remote_url
from ..storage import SHM_SCHEME, normalize

SOURCES = ("peer", "root")
LOCAL_KINDS = ("disk", "shm")


def _state(rank: int, world: int, mb_per_rank: float, fill: bool) -> dict:
    import statesnap as ss

    rows = max(1, int(mb_per_rank * 1e6 / 4 / 1024))
    local = torch.arange(rows * 1024, dtype=torch.float32).reshape(rows, 1024) + rank * 1e6 if fill \
        else torch.zeros(rows, 1024)
    return {"weights": ss.Sharded(local, (rows * world, 1024), (rows * rank, 0))}


def measure(rank: int, world: int, mb_per_rank: float, repeat: int, out: str, remote_mb_per_s: float,
            remote_latency_ms: float, local_roots: list[str]) -> dict:
    import statesnap as ss

    node = int(rank >= world // 2)
    root = remote_url(os.path.join(out, "root"), remote_mb_per_s, remote_latency_ms)
    levels = dict(local_root=local_roots[node], node_id=node, peer_replicas=1, durable=False, host_memory_gb=
                  max(0.05, 3 * mb_per_rank / 1e3))
    saved = _state(rank, world, mb_per_rank, fill=True)
    with ss.Checkpointer(root, **levels) as ckpt:
        ckpt.save(1, saved).wait()
    times: dict[str, list[float]] = {}
    for _ in range(repeat):  # interleaved, so drifts in machine load hit both alike
        for source in SOURCES:
            if rank == 0:
                shutil.rmtree(normalize(local_roots[1]), ignore_errors=True)  # node 1 was replaced
            dist.barrier()
            target = _state(rank, world, mb_per_rank, fill=False)
            ckpt = ss.Checkpointer(root, **(levels if source == "peer" else dict(durable=False)))
            try:
                times.setdefault(source, []).append(_barrier_timed(lambda: ckpt.load_latest(target)))
                expected = "peer" if source == "peer" else "persistent"
                if ckpt.loaded_from != expected:
                    raise RuntimeError(f"restored from {ckpt.loaded_from}, not {expected}")
            finally:
                ckpt.close()
            if not torch.equal(target["weights"].local, saved["weights"].local):
                raise RuntimeError(f"rank {rank}: the state restored from {source} differs from the one saved")
    return times


def run(ranks: int = 4, mb_per_rank: float = 64.0, repeat: int = 3, out: str = DEFAULT_OUT,
        remote_mb_per_s: float = 100.0, remote_latency_ms: float = 10.0, local: str = "disk") -> dict:
    """Spawn the job; return median seconds per source (slowest rank) and root / peer."""
    if ranks < 2 or ranks % 2:
        raise ValueError(f"--ranks must be even and at least 2 (two simulated nodes), not {ranks}")
    if local not in LOCAL_KINDS:
        raise ValueError(f"--local must be one of {', '.join(LOCAL_KINDS)}, not {local!r}")
    scratch = fresh_dir(os.path.join(out, "recovery"))
    os.makedirs(os.path.join(scratch, "root"))  # the local file system under throttled:// makes no parents
    base = os.path.join(scratch, "") if local == "disk" else f"{SHM_SCHEME}statesnap-bench-{uuid.uuid4().hex[:8]}/"
    local_roots = [f"{base}node{n}" for n in (0, 1)]
    args = dict(mb_per_rank=mb_per_rank, repeat=repeat, out=scratch, remote_mb_per_s=remote_mb_per_s,
                remote_latency_ms=remote_latency_ms, local_roots=local_roots)
    try:
        per_rank = run_job(ranks, measure, args)
    finally:
        remove_scratch(scratch)
        shutil.rmtree(os.path.dirname(normalize(local_roots[0])), ignore_errors=True)
    seconds = {source: median(max(t[source][i] for t in per_rank) for i in range(repeat)) for source in SOURCES}
    return {"ranks": ranks, "mb_per_rank": mb_per_rank, "repeat": repeat, "local": local, "local_roots": local_roots,
            "seconds": seconds,
            "remote": {"mb_per_s": remote_mb_per_s, "latency_ms": remote_latency_ms},
            "root_vs_peer": seconds["root"] / seconds["peer"]}


def report(result: dict) -> str:
    rows = [(source, result["seconds"][source]) for source in SOURCES]
    return (f"{result['ranks']} ranks on 2 simulated nodes, {result['mb_per_rank']:g} MB per rank, node-local "
            f"levels on {result['local']}; root: "
            f"{result['remote']['mb_per_s']:g} MB/s per process, {result['remote']['latency_ms']:g} ms per request\n"
            + format_table(["restart after node loss, from", "seconds (median)"], rows)
            + f"\n\nroot / peer: {result['root_vs_peer']:.2f}x (aim: >= 5x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statesnap bench --suite recovery", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=positive_int, default=4, help="processes, half of them on each simulated node")
    parser.add_argument("--mb-per-rank", type=positive_float, default=64.0, help="sharded state per rank, MB")
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--remote-mbps", type=positive_float, default=100.0,
                        help="bandwidth of each process to the simulated object store (root), MB/s")
    parser.add_argument("--remote-latency-ms", type=positive_float, default=10.0, help="latency of each request to it")
    parser.add_argument("--local", choices=LOCAL_KINDS, default="disk",
                        help="where the node-local levels live: this machine's disk, or its shared memory (shm://)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    result = run(args.ranks, args.mb_per_rank, args.repeat, args.out, args.remote_mbps, args.remote_latency_ms,
                 args.local)
    publish(result, report(result), args.json)
    return 0
