"""A DeepSpeed ZeRO-3 checkpoint for ``statesnap bench --suite convert`` (run under torchrun).

``python -m torch.distributed.run --standalone --nproc_per_node=2 -m statesnap.bench.ds_producer
OUT DIM LAYERS``: a stack of ``LAYERS`` square ``DIM`` linear layers, fp32, torch AdamW, one step
on the CPU with gloo, saved as ``OUT/global_step1``. Needs deepspeed (the ``producers`` extra) and
``DS_ACCELERATOR=cpu`` on a machine without a GPU.
"""
from __future__ import annotations

import sys


def init_gloo() -> None:
    """Join the job's gloo group without DeepSpeed's shared-memory all-reduce kernel. DeepSpeed
    compiles that kernel (minutes on two cores, again whenever the build directory's paths
    change) on its first ``init_distributed``; gloo carries these small producers' collectives
    as well, and a checkpoint's layout does not depend on which of the two reduced."""
    import deepspeed
    import deepspeed.ops

    # (DeepSpeed probes each op once and keeps this dict: its edits persist for the process)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")


def main(out: str, dim: int, layers: int) -> None:
    import deepspeed
    import torch
    from torch import nn

    init_gloo()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                           config=config)
    x = torch.randn(2, dim)
    engine.backward(engine(x).square().mean())
    engine.step()
    engine.save_checkpoint(out, tag="global_step1")
    from .teardown import leave_together

    leave_together()  # gloo aborts a rank whose group is torn down at exit after a peer has gone


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
