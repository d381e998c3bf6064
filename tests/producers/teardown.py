"""How every producer run ends: all ranks together, process groups destroyed before exit.

A rank that reaches interpreter exit while its gloo process group is still alive tears it down in
the C++ destructors; if a peer has already closed its connections by then, gloo's background
threads abort the process ('terminate called without an active exception', exit -6), failing a
run whose checkpoint was complete (seen once in a test run of ds_train.py). A barrier and an
explicit ``destroy_process_group`` end the run cleanly on every rank.
"""
import torch.distributed as dist


def leave_together() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
