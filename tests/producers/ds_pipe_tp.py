"""A DeepSpeed pipeline of tensor-parallel layers (PP=2 x TP=2, ZeRO-1, bf16): ``ds_pipe_tp.py <outdir>``
on 4 gloo ranks.

``PipelineModule`` on a ``PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)``, as
Megatron-DeepSpeed builds GPT: each stage holds a column-parallel linear (``weight``/``bias`` cut
along the output dimension) and a row-parallel one (``weight`` cut along the input dimension, its
``bias`` whole on every TP rank, the partial products summed over the TP group). DeepSpeed writes
``layer_XX-model_YY-model_states.pt`` (one per layer and TP rank), ``mp_rank_XX_model_states.pt``
and ``bf16_zero_pp_rank_0_mp_rank_XX_optim_states.pt`` per (stage, TP rank), XX = stage x 2 +
TP rank; ``universal_checkpoint_info`` goes in the client state, as Megatron-DeepSpeed puts it.
Each rank writes ``<outdir>/truth_rank<r>.pt``: its slices of the weights (``model``), fp32 master
weights and Adam moments, gathered through DeepSpeed's public API.
"""
import sys

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from ds_train import save_with_rank_truths  # the script's directory is on sys.path

from statesnap.bench.ds_producer import init_gloo

TOPOLOGY = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
TP = 2
UNIVERSAL_CHECKPOINT_INFO = {  # parameter names are PipelineModule's: <layer index>.<name>
    "universal_checkpoint_version": 0.2,
    "tp_replicated_parameter_patterns": [r"^[13]\.bias$"],
    "parameter_with_row_parallelism_patterns": [r"^[13]\.weight$"],
}
_tp_group = []  # the TP process group, known once PipelineModule has built its grid


class _SlicedLinear(nn.Module):
    """This TP rank's slice (along ``CUT``: 0 column-, 1 row-parallel) of a linear layer drawn whole,
    alike on every rank (same seed); a row-parallel bias stays whole."""
    CUT = 0

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        full = nn.Linear(in_features, out_features).to(torch.bfloat16)
        rank = TOPOLOGY.get_coord(dist.get_rank()).model
        self.weight = nn.Parameter(full.weight.detach().chunk(TP, self.CUT)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().chunk(TP, 0)[rank].clone() if self.CUT == 0 else
                                 full.bias.detach().clone())


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: the input as is; its gradient summed over the TP group (each rank's is partial)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=_tp_group[0])
        return grad


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: the partial outputs summed over the TP group; the gradient as is."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, group=_tp_group[0])
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class ColumnParallelLinear(_SlicedLinear):
    CUT = 0

    def forward(self, x):
        return torch.relu(nn.functional.linear(_CopyToTP.apply(x), self.weight, self.bias))


class RowParallelLinear(_SlicedLinear):
    CUT = 1

    def forward(self, x):
        return _ReduceFromTP.apply(nn.functional.linear(x, self.weight)) + self.bias


def main():
    outdir = sys.argv[1]
    init_gloo()
    torch.manual_seed(0)
    layers = [LayerSpec(ColumnParallelLinear, 16, 24), LayerSpec(RowParallelLinear, 24, 16),
              LayerSpec(ColumnParallelLinear, 16, 20), LayerSpec(RowParallelLinear, 20, 8)]
    model = PipelineModule(layers=layers, topology=TOPOLOGY, loss_fn=nn.MSELoss(), partition_method="uniform")
    _tp_group.append(model.mpu().get_slice_parallel_group())
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
           # torch_adam: torch's AdamW; DeepSpeed's FusedAdam compiles for minutes on a CPU
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    batches = iter([(torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(2, 8, dtype=torch.bfloat16))
                    for _ in range(6)])
    for _ in range(3):
        engine.train_batch(data_iter=batches)
    save_with_rank_truths(engine, outdir, {"universal_checkpoint_info": UNIVERSAL_CHECKPOINT_INFO})


if __name__ == "__main__":
    from statesnap.bench.teardown import leave_together

    main()
    leave_together()
