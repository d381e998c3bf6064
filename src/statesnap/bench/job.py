"""A job of gloo ranks on this machine, for the suites that measure collective loads and saves.

The parent holds the rendezvous store on a port the kernel picked, for the whole job: binding
port 0, closing it and telling the ranks the number lets another process (another test's ranks,
a store) take the port before they bind it. A rank that raises, or dies without a word, fails
the job at once instead of leaving the parent waiting.
"""
from __future__ import annotations

import os
import queue as queues
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, work: Callable, args: dict, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        results.put((rank, True, work(rank, world, **args)))
    except BaseException as exc:
        results.put((rank, False, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_job(world: int, work: Callable, args: dict, timeout_s: float = 1800) -> list:
    """``work(rank, world, **args)`` on ``world`` spawned gloo ranks (a module-level function);
    return what each rank returned, in rank order. Raises ``RuntimeError`` naming the first rank
    that failed or died."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, store.port, work, args, results)) for r in range(world)]
    for proc in procs:
        proc.start()
    returned: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(returned) < world:
            try:
                rank, ok, value = results.get(timeout=1)
            except queues.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in returned]
                if dead:
                    raise RuntimeError(f"rank {dead[0][0]} died (exit code {dead[0][1]}) without a result") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the job did not finish within {timeout_s:.0f} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed: {value}")
            returned[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=60 if len(returned) == world else 1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [returned[r] for r in range(world)]
