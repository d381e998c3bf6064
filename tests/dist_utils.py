"""Run a function on N real gloo ranks (separate processes) on 127.0.0.1 and collect results.

Determinism: tests compare, bit for bit, values that different ranks computed on their own
(replicas trained alike on every rank are stored once, from one rank, and loaded by all; the
library also compares replicas by hash and refuses a save whose replicas differ). That holds
only if every rank does the same arithmetic in the same order, so each rank runs with one
intra-op and one inter-op thread: with more, reductions and matrix products are split by the
thread count, which depends on the machine and on what else was set in the process.

Ports: the parent binds the rendezvous store itself (port 0, chosen by the kernel and held from
then on) and the ranks join it as clients. Picking a free port, closing it and letting rank 0
bind it seconds later raced with every other process on the machine (another xdist worker's
ranks, their gloo connections) that could take the port in between.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from statesnap.bench.job import begin_rank, callers_place, rank_context

STORE_TIMEOUT = timedelta(minutes=30)  # what init_process_group gives its own store
GRACE_S = 60  # how long the other ranks may take to finish or fail once one rank has failed


def free_port() -> int:
    """A port that was free a moment ago (racy: another process may take it before it is bound).
    ``run_ranks`` does not use it; kept for tests that start ranks themselves."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin_threads() -> None:
    """One intra-op and one inter-op thread, and the same for processes started from here."""
    import torch

    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or inter-op work has started: it can be set only once
        pass


def _rank_main(rank, world_size, port, payload, results, place):
    try:
        fn, args = begin_rank(place, payload, rank, world_size, port, STORE_TIMEOUT)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        pin_threads()
        # Pickled here, by value: a tensor put on a multiprocessing queue as it is travels as a
        # file descriptor that this process must still hold when the parent unpickles it, and on a
        # loaded machine the rank had often exited by then (FileNotFoundError in the parent).
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout: float = 240, hash_seeds: list[int] | None = None):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``hash_seeds``: spawn each rank as a fresh interpreter with its own ``PYTHONHASHSEED``, so
    that sets of strings iterate in another order on each rank, as on the ranks of a real job
    (the ranks forked otherwise all share the server's); code that assumed one order everywhere
    then fails every time.

    ``fn`` must be importable (a module-level function). Any rank's exception fails the call with
    that rank's traceback. ``timeout`` bounds the wait for each next result (not the whole run). A
    rank that dies without a result, or one still running ``GRACE_S`` after another rank failed
    (typically waiting in a collective for the failed one), is named as such instead of hiding
    the first rank's traceback behind a queue timeout."""
    # Ranks fork from a server: a fresh interpreter this process started, with this process's
    # environment then (pin_threads's OMP_NUM_THREADS=1 among it), so its OpenBLAS and OpenMP have
    # no threads that a fork could leave half-held.
    ctx = rank_context() if hash_seeds is None else mp.get_context("spawn")
    payload = pickle.dumps((fn, args))
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=STORE_TIMEOUT)
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, store.port, payload, results, callers_place()))
             for r in range(world_size)]
    for rank, p in enumerate(procs):
        if hash_seeds is None:
            p.start()
        else:  # (a spawned interpreter takes the environment of this process as it starts)
            before = os.environ.get("PYTHONHASHSEED")
            os.environ["PYTHONHASHSEED"] = str(hash_seeds[rank])
            try:
                p.start()
            finally:
                if before is None:
                    del os.environ["PYTHONHASHSEED"]
                else:
                    os.environ["PYTHONHASHSEED"] = before
    values, errors = {}, {}
    deadline, failed_at = time.monotonic() + timeout, None
    try:
        while len(values) + len(errors) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue_module.Empty:
                pending = [r for r in range(world_size) if r not in values and r not in errors]
                dead = [r for r in pending if procs[r].exitcode is not None]
                now = time.monotonic()
                if dead:  # its result may still be in the pipe: one more look before giving up on it
                    try:
                        rank, status, value = results.get(timeout=5.0)
                    except queue_module.Empty:
                        errors.update({r: f"exited with code {procs[r].exitcode} without a result" for r in dead})
                        failed_at = failed_at or now
                        continue
                elif failed_at is not None and now > failed_at + GRACE_S:
                    errors.update({r: f"still running {GRACE_S} s after another rank failed (killed)"
                                   for r in pending})
                    break
                elif now > deadline:
                    errors.update({r: f"no result within {timeout:.0f} s (killed)" for r in pending})
                    break
                else:
                    continue
            if status == "ok":
                values[rank] = pickle.loads(value)
            else:
                errors[rank] = value
                failed_at = failed_at or time.monotonic()
            deadline = time.monotonic() + timeout
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    if errors:
        raise AssertionError("\n".join(f"rank {r}:\n{errors[r]}" for r in sorted(errors)))
    return [values[r] for r in range(world_size)]


def local_level(local_root, root) -> str:
    """The node-local level of the job whose persistent root is ``root``: its own directory under
    ``local_root`` (``statesnap.checkpointer.local.job_directory``)."""
    from statesnap.checkpointer.local import job_directory
    from statesnap.storage import backend_for, normalize

    local_root = normalize(os.fspath(local_root))
    return job_directory(local_root, normalize(os.fspath(root)), backend_for(local_root, None))
