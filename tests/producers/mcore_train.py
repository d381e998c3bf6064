"""Megatron DDP + distributed optimizer training, model and optimizer saved with dist_checkpointing:
``mcore_train.py <outdir> <sharding type>`` on 2 gloo ranks (TP=1, DP=2), or 4 ranks with TP=2 DP=2
(``MCORE_TP=2``), PP=2 DP=2 (``MCORE_PP=2``) or TP=2 PP=2 (both).

Under pipeline parallelism (4 layers, 2 per stage) each stage holds only its layers, the first the
embeddings and the last the output layer tied to them. A pipeline schedule needs CUDA streams for
its point-to-point transfers, so there the steps take gradients the script sets itself, the same
for both tied copies (as Megatron's embedding-group all-reduce makes them): the optimizer's state is
still what megatron-core's distributed optimizer computes and saves.

A GPT model (LayerNorm, GELU, biases, tied embeddings) trains 2 Adam steps (gradients in buckets
of about ``$MCORE_BUCKET_ELEMENTS`` elements if set) through
``get_megatron_optimizer`` (a ChainedOptimizer over a DistributedOptimizer), then
``dist_checkpointing.save`` writes ``{"model": ..., "optimizer": opt.sharded_state_dict(...,
metadata={"distrib_optim_sharding_type": <sharding type>})}`` to ``<outdir>/dist``. Each rank writes
``<outdir>/truth_rank<r>.pt``: its TP rank, its ``named_parameters()`` and, for each of them, the fp32 master
weight and the Adam moments of the whole parameter, gathered from every DP rank's shard through
the optimizer's own ``model_param_gbuf_map``/``param_range_map`` bookkeeping (all-reduced over DP).
"""
import os
import sys

import torch
import torch.distributed as dist

import cpu_shim  # the script's directory is on sys.path

cpu_shim.install()

VOCAB = 128


def main():
    outdir, sharding = sys.argv[1], sys.argv[2]
    tp, pp = int(os.environ.get("MCORE_TP", "1")), int(os.environ.get("MCORE_PP", "1"))
    dist.init_process_group("gloo")
    cpu_shim.install_megatron_rng()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2 * pp, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            pipeline_dtype=torch.float32, params_dtype=torch.float32, hidden_dropout=0.0,
                            attention_dropout=0.0, masked_softmax_fusion=False, bias_activation_fusion=False,
                            bias_dropout_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
                            persist_layer_norm=False)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                   max_sequence_length=16, share_embeddings_and_output_weights=True,
                   pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    # MCORE_BUCKET_ELEMENTS: small buckets (megatron-core buckets only with overlap_grad_reduce), each
    # padded to a multiple of lcm(DP, 128) elements; unset: one bucket
    bucket = int(os.environ.get("MCORE_BUCKET_ELEMENTS", "0")) or None
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=bucket is not None,
                                            bucket_size=bucket)
    model = DistributedDataParallel(cfg, ddp_cfg, gpt)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [model])
    generator = torch.Generator().manual_seed(1 + ps.get_data_parallel_rank())
    ids = torch.randint(0, VOCAB, (2, 16), generator=generator)
    positions = torch.arange(16).expand_as(ids)
    mask = torch.ones(16, 16, dtype=torch.bool).triu(1)[None, None]
    for _ in range(2):
        model.zero_grad_buffer()
        opt.zero_grad()
        if pp == 1:
            model(ids, positions, mask, labels=ids).float().mean().backward()
        else:
            set_gradients(gpt, generator)
        model.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok
    sd = {"model": gpt.sharded_state_dict(prefix="model.")}
    sd["optimizer"] = opt.sharded_state_dict(gpt.sharded_state_dict(prefix="model."),
                                             metadata={"distrib_optim_sharding_type": sharding})
    os.makedirs(f"{outdir}/dist", exist_ok=True)
    dist_checkpointing.save(sd, f"{outdir}/dist")
    torch.save(truth(gpt, opt.chained_optimizers[0]), f"{outdir}/truth_rank{dist.get_rank()}.pt")
    dist.barrier()


def set_gradients(gpt, generator) -> None:
    """Gradients into megatron-core's grad buffers (``main_grad``): drawn per parameter from the DP
    rank's generator, keyed by the parameter's place, so that the tied output layer gets the
    embedding's and TP replicas get the same."""
    from megatron.core import parallel_state as ps
    for name, param in gpt.named_parameters():
        tied = name in ("output_layer.weight", "embedding.word_embeddings.weight")
        stage = 0 if tied else ps.get_pipeline_model_parallel_rank()  # local layer names repeat across stages
        # a TP-replicated parameter (norms, position embeddings, row-parallel biases) gets the same
        # gradient on every TP rank, as the replicated computation gives it
        tp_rank = ps.get_tensor_model_parallel_rank() if getattr(param, "tensor_model_parallel", False) else 0
        seed = sum(map(ord, f"{'tied' if tied else name}|{tp_rank}|{stage}"))
        g = torch.Generator().manual_seed(seed * 1000 + int(generator.initial_seed()))
        param.main_grad.copy_(torch.randn(param.shape, generator=g) * 1e-2)


def truth(gpt, dist_opt) -> dict:
    """The rank's parameters and each one's whole fp32 master and Adam moments: every DP rank fills
    its own range of a zero tensor and a sum over DP assembles the parameter."""
    from megatron.core import parallel_state as ps
    out = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}, "master": {}, "tp": ps.get_tensor_model_parallel_rank(),
           "pp": ps.get_pipeline_model_parallel_rank()}
    group = ps.get_data_parallel_group()
    for name, param in gpt.named_parameters():
        out["params"][name] = param.detach().clone()
        full = {key: torch.zeros(param.numel()) for key in ("exp_avg", "exp_avg_sq", "master")}
        if param in dist_opt.model_param_gbuf_map:  # this DP rank owns a piece of it
            gbuf_index, dtype, bucket_index = dist_opt.model_param_gbuf_map[param]
            piece = dist_opt.gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"][param]["param"]
            group_index, order = dist_opt.model_param_group_index_map[param]
            master = dist_opt.optimizer.param_groups[group_index]["params"][order]
            state = dist_opt.optimizer.state[master]
            full["master"][piece.start:piece.end] = master.detach().view(-1)
            full["exp_avg"][piece.start:piece.end] = state["exp_avg"].view(-1)
            full["exp_avg_sq"][piece.start:piece.end] = state["exp_avg_sq"].view(-1)
        for key, tensor in full.items():
            dist.all_reduce(tensor, group=group)
            out[key][name] = tensor.view(param.shape)
    return out


if __name__ == "__main__":
    from statesnap.bench.teardown import leave_together

    main()
    leave_together()
