"""A megatron-core GPT model saved in both Megatron layouts: ``mcore_gpt.py <outdir> <flavour> <tp> <pp>``
on ``tp * pp`` gloo ranks.

``flavour`` is ``gpt`` (LayerNorm, GELU, biases, learned positions, embeddings tied to the output
layer across pipeline stages) or ``llama`` (RMSNorm, SwiGLU, no biases, RoPE, 2 query groups for 4
heads, untied embeddings). The vocabulary is padded the way Megatron-LM pads it (250 -> 256) and
``args`` records both sizes, as Megatron-LM's ``args`` would. Writes:

- ``<outdir>/dist``: ``dist_checkpointing.save`` (torch_dist backend) of
  ``model.sharded_state_dict(prefix="model.")`` plus the common ``args``/``iteration``/``checkpoint_version``;
- ``<outdir>/classic/iter_0000007/mp_rank_XX[_YYY]/model_optim_rng.pt``: Megatron-LM's legacy
  per-rank files ``{"model": state_dict_for_save_checkpoint(), "iteration", "checkpoint_version",
  "args"}`` and ``latest_checkpointed_iteration.txt``;
- ``<outdir>/truth_rank<r>.pt``: the rank's ``named_parameters()``, its TP/PP coordinates and, for
  a one-stage model, the logits of ``TOKENS`` (eval mode, full vocabulary).
"""
import argparse
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

import cpu_shim  # the script's directory is on sys.path

cpu_shim.install()  # at import, so dist_checkpointing's spawned helpers get it too; tied embeddings call .cuda()

ITERATION = 7
VOCAB, PADDED_VOCAB = 250, 256
TOKENS = [[3, 17, 249, 0, 101, 42, 7, 200], [5, 5, 77, 130, 9, 248, 1, 66]]


def config(flavour: str, tp: int, pp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig
    common = dict(num_layers=4, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                  tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                  params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                  masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                  gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    if flavour == "llama":
        import torch.nn.functional as F
        common.update(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                      num_query_groups=2, ffn_hidden_size=96, layernorm_epsilon=1e-5)
    return TransformerConfig(**common)


def main():
    outdir, flavour, tp, pp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    cpu_shim.install_megatron_rng()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(0)
    llama = flavour == "llama"
    model = GPTModel(config=config(flavour, tp, pp), transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=PADDED_VOCAB, max_sequence_length=64, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), parallel_output=False,
                     share_embeddings_and_output_weights=not llama,
                     position_embedding_type="rope" if llama else "learned_absolute")
    rank, tp_rank, pp_rank = dist.get_rank(), ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    args = argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, num_layers=4,
                              hidden_size=64, vocab_size=VOCAB, padded_vocab_size=PADDED_VOCAB, make_vocab_size_divisible_by=128,
                              untie_embeddings_and_output_weights=llama)
    common = {"args": args, "iteration": ITERATION, "checkpoint_version": 3.0}

    os.makedirs(f"{outdir}/dist", exist_ok=True)
    dist_checkpointing.save({**model.sharded_state_dict(prefix="model."), **common}, f"{outdir}/dist")

    folder = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
    classic = f"{outdir}/classic/iter_{ITERATION:07d}/{folder}"
    os.makedirs(classic, exist_ok=True)
    # rng_state as Megatron-LM writes it (numpy's RNG state pickles numpy arrays)
    rng_state = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                  "torch_rng_state": torch.get_rng_state()}]
    torch.save({"model": model.state_dict_for_save_checkpoint(), "rng_state": rng_state, **common},
               f"{classic}/model_optim_rng.pt")
    if rank == 0:
        with open(f"{outdir}/classic/latest_checkpointed_iteration.txt", "w") as f:
            f.write(str(ITERATION))

    truth = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "tp": tp_rank, "pp": pp_rank}
    if pp == 1:
        model.eval()
        ids = torch.tensor(TOKENS)
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)[None, None]
        with torch.no_grad():
            truth["logits"] = model(ids, positions, mask)
    torch.save(truth, f"{outdir}/truth_rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    from statesnap.bench.teardown import leave_together

    main()
    leave_together()
