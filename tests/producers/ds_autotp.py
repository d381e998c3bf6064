"""DeepSpeed AutoTP training (TP=2, ZeRO-1) of a tiny Llama: ``ds_autotp.py <outdir>`` on 2 gloo ranks.

AutoTP slices the model's linear layers itself (``"tensor_parallel": {"autotp_size": 2}``), writes
``mp_rank_0X_model_states.pt`` with TP-sliced tensors and ``universal_checkpoint_info`` describing
which patterns are replicated, row-parallel or vocabulary tensors. Each rank writes
``<outdir>/truth_rank<r>.pt``: its slices of the weights (``model``) and of the fp32 master weights
and Adam moments (``fp32``, ``exp_avg``, ``exp_avg_sq``), gathered through DeepSpeed's public API.
"""
import sys

import deepspeed
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ds_train import save_with_rank_truths  # the script's directory is on sys.path


def main():
    outdir = sys.argv[1]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                         intermediate_size=48, vocab_size=64, max_position_embeddings=32, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 8))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    save_with_rank_truths(engine, outdir)


if __name__ == "__main__":
    from teardown import leave_together  # the script's directory is on sys.path

    main()
    leave_together()
