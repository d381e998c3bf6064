"""DeepSpeed AutoTP training (TP=2, ZeRO-1) of a tiny model: ``ds_autotp.py <outdir> [llama|phi3]`` on 2 gloo ranks.

AutoTP slices the model's linear layers itself (``"tensor_parallel": {"autotp_size": 2}``), writes
``mp_rank_0X_model_states.pt`` with TP-sliced tensors and ``universal_checkpoint_info`` describing
which patterns are replicated, row-parallel or vocabulary tensors. ``phi3`` (grouped-query
attention, 4 query and 2 key/value heads) adds fused weights whose sub-parameters have different
sizes: ``qkv_proj`` is [q (32 rows) | k (16) | v (16)] and ``gate_up_proj`` [gate | up], each
rank holding its slice of every sub-parameter, listed under ``parameter_with_sub_params`` with
``sub_param_shard_widths``. Each rank writes ``<outdir>/truth_rank<r>.pt``: its slices of the
weights (``model``) and of the fp32 master weights and Adam moments (``fp32``, ``exp_avg``,
``exp_avg_sq``), gathered through DeepSpeed's public API, and rank 0 ``<outdir>/gathered_model.bin``:
the full module weights, gathered by DeepSpeed's ``GatherReplacedLayerParams``.
"""
import sys

import deepspeed
import torch
from deepspeed.module_inject.layers import GatherReplacedLayerParams
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

from ds_train import save_with_rank_truths  # the script's directory is on sys.path

from statesnap.bench.ds_producer import init_gloo

SIZES = dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=48,
             vocab_size=64, max_position_embeddings=32, tie_word_embeddings=False)
MODELS = {"llama": lambda: LlamaForCausalLM(LlamaConfig(**SIZES)),
          "phi3": lambda: Phi3ForCausalLM(Phi3Config(**SIZES, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                                 attn_implementation="eager"))}
# Phi-3's own preset declares qkv_proj as 3 equal sub-parameters, wrong under grouped-query
# attention; the layout is given as Megatron-DeepSpeed-style users give it: [q | k | v] rows.
PARTITIONS = {"phi3": {"partition_config": {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.self_attn\.o_proj\.weight$", r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
    {"patterns": [r".*\.self_attn\.qkv_proj\.weight$"], "partition_type": "column", "shape": [[32, 16, 16], -1],
     "partition_dim": 0},
    {"patterns": [r".*\.mlp\.gate_up_proj\.weight$"], "partition_type": "column", "shape": [2, -1],
     "partition_dim": 0}]}}}


def main():
    outdir = sys.argv[1]
    kind = sys.argv[2] if len(sys.argv) > 2 else "llama"
    init_gloo()
    torch.manual_seed(0)
    model = MODELS[kind]()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2, **PARTITIONS.get(kind, {})},
           # torch_adam: torch's AdamW; DeepSpeed's FusedAdam compiles for minutes on a CPU
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if kind == "phi3":  # AutoTP set the layers' own head counts; Phi-3 finds q in qkv by the config's
        model.config.num_attention_heads //= 2
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 8))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    save_with_rank_truths(engine, outdir)
    gathered = gathered_weights(engine.module)
    if torch.distributed.get_rank() == 0:
        torch.save(gathered, f"{outdir}/gathered_model.pt")


def gathered_weights(model) -> dict:
    """The full weights, every rank's AutoTP slices joined by DeepSpeed's own gather (a collective),
    which knows each layer's sub-parameter layout."""
    out = {}
    for prefix, module in model.named_modules():
        with GatherReplacedLayerParams(list(module.parameters(recurse=False)), module, enabled=True):
            for name, param in module.named_parameters(recurse=False):
                out[f"{prefix}.{name}" if prefix else name] = param.detach().clone()
    return out


if __name__ == "__main__":
    from statesnap.bench.teardown import leave_together

    main()
    leave_together()
