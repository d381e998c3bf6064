"""How every multi-rank run of a third-party trainer that writes a checkpoint ends (the test
suite's producers under tests/producers and its Lightning runs, tests/integrations/lightning_train.py,
and ``ds_producer`` of the convert suite): all ranks together, then out without C++ teardown.

A rank that reaches interpreter exit while its gloo process group is still alive tears it down in
the C++ destructors; if a peer has already closed its connections by then, gloo's background
threads abort the process ('terminate called without an active exception', exit -6), failing a
run whose checkpoint was complete (seen in test runs of ds_train.py and of ds_autotp.py's Phi-3,
and in the convert suite's ``ds_producer``, each after a barrier and ``destroy_process_group``:
DeepSpeed keeps threads and groups of its own; and once in 2026-11 in a 2-rank Lightning FSDP2
run, whose default group Lightning destroys only in an ``atexit`` handler). So the ranks meet at a barrier once every file
is written and closed, destroy the groups, flush the output and leave with ``os._exit(0)``,
which runs no destructors. That also
skips multiprocessing's exit handler, which stops the helper processes a library started
(dist_checkpointing's writers): they are stopped here first, or they would live on holding the
run's output pipes open. A rank that failed before this point still exits non-zero through its
exception.
"""
from __future__ import annotations

import multiprocessing
import os
import sys

import torch.distributed as dist


def leave_together() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    for child in multiprocessing.active_children():
        child.terminate()
        child.join()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
