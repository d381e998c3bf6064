"""A DeepSpeed pipeline engine (PP=2, ZeRO-1): ``ds_pipe.py <outdir>`` on 2 gloo ranks.

``PipelineModule`` names its layers by position (``0.weight``, ``4.bias``) and writes one
``layer_XX-model_states.pt`` per layer plus one ``mp_rank_0X_model_states.pt`` per stage. Each rank
writes ``<outdir>/truth_rank<r>.pt``: its stage's weights (``model``) and full Adam moments
(``exp_avg``, ``exp_avg_sq``), gathered through DeepSpeed's public API.
"""
import sys

import deepspeed
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule

from ds_train import save_with_rank_truths  # the script's directory is on sys.path

from statesnap.bench.ds_producer import init_gloo


def main():
    outdir = sys.argv[1]
    init_gloo()
    torch.manual_seed(0)
    layers = [LayerSpec(nn.Linear, 16, 30), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 30, 30), LayerSpec(nn.ReLU),
              LayerSpec(nn.Linear, 30, 8)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
           "zero_optimization": {"stage": 1},
           # torch_adam: torch's AdamW; DeepSpeed's FusedAdam compiles for minutes on a CPU
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    batches = [(torch.randn(2, 16), torch.randn(2, 8)) for _ in range(6)]
    it = iter(batches)
    for _ in range(3):
        engine.train_batch(data_iter=it)
    save_with_rank_truths(engine, outdir)


if __name__ == "__main__":
    from statesnap.bench.teardown import leave_together

    main()
    leave_together()
