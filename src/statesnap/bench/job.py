"""A job of gloo ranks on this machine, for the suites that measure collective loads and saves.

The parent holds the rendezvous store on a port the kernel picked, for the whole job: binding
port 0, closing it and telling the ranks the number lets another process (another test's ranks,
a store) take the port before they bind it. A rank that raises, or dies without a word, fails
the job at once instead of leaving the parent waiting.
"""
from __future__ import annotations

import os
import pickle
import queue as queues
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_context():
    """A multiprocessing context whose processes fork from a server that imported torch and
    statesnap once: a spawned rank spends seconds importing them. Such a
    process starts with the server's environment and working directory, which were the caller's
    when the server started: hand it ``callers_place()`` and let it ``enter_place`` first. Its
    arguments are unpickled before its target runs, so a function or value whose unpickling
    imports a module (a test module, a library the server did not preload) would import it in the
    server's environment: pass those pickled (``pickle.dumps``) and load them after ``enter_place``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "statesnap.checkpointer", "statesnap.engine.save",
                                "statesnap.engine.load"])
    return ctx


def callers_place() -> tuple[dict, str]:
    """This process's environment and working directory, for ``enter_place`` in a rank."""
    return dict(os.environ), os.getcwd()


def enter_place(place: tuple[dict, str]) -> None:
    """Take the environment and working directory ``callers_place`` gave, as a spawned process
    would have started with them."""
    environ, cwd = place
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)


def begin_rank(place: tuple[dict, str], payload: bytes, rank: int, world: int, port: int,
               timeout: timedelta = timedelta(minutes=30)):
    """A rank's start: take the caller's place, unpickle the work there (importing its module
    runs that module's code, which must see the caller's environment as under "spawn"), then join
    the job's gloo group at the store on ``port``; return the work."""
    enter_place(place)
    work = pickle.loads(payload)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return work


def _rank(rank: int, world: int, port: int, payload: bytes, results, place) -> None:
    try:
        work, args = begin_rank(place, payload, rank, world, port)
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        value = work(rank, world, **args)
        pickle.dumps(value)  # the queue pickles on a thread of its own, which would drop it silently
        results.put((rank, True, value))
    except BaseException as exc:
        results.put((rank, False, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_job(world: int, work: Callable, args: dict, timeout_s: float = 1800) -> list:
    """``work(rank, world, **args)`` on ``world`` gloo ranks (a module-level function);
    return what each rank returned, in rank order. Raises ``RuntimeError`` naming the first rank
    that failed or ended without a result."""
    payload = pickle.dumps((work, args))
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    ctx = rank_context()
    results = ctx.Queue()
    procs = []
    returned: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    ended_before: set[int] = set()
    try:
        for rank in range(world):
            proc = ctx.Process(target=_rank, args=(rank, world, store.port, payload, results, callers_place()))
            proc.start()
            procs.append(proc)  # (only a started one can be joined below, should the next start fail)
        while len(returned) < world:
            try:
                rank, ok, value = results.get(timeout=1)
            except queues.Empty:
                ended = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and r not in returned]
                late = [(r, code) for r, code in ended if r in ended_before]  # a whole second after it ended
                if late:
                    raise RuntimeError(f"rank {late[0][0]} ended (exit code {late[0][1]}) without a result") from None
                ended_before.update(r for r, _ in ended)
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
        del store  # stops its server
    return [returned[r] for r in range(world)]
