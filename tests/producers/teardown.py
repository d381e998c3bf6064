"""How every producer run ends: all ranks together, then out without C++ teardown.

A rank that reaches interpreter exit while its gloo process group is still alive tears it down in
the C++ destructors; if a peer has already closed its connections by then, gloo's background
threads abort the process ('terminate called without an active exception', exit -6), failing a
run whose checkpoint was complete (seen in test runs of ds_train.py and of ds_autotp.py's Phi-3,
the latter even after a barrier and ``destroy_process_group``: DeepSpeed keeps threads and groups
of its own). So the ranks meet at a barrier once every file is written and closed, destroy the
groups, flush the output and leave with ``os._exit(0)``, which runs no destructors. A rank that
failed before this point still exits non-zero through its exception.
"""
import os
import sys

import torch.distributed as dist


def leave_together() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
