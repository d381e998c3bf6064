"""DeepSpeed ZeRO on a tiny model: ``ds_train.py <stage> <outdir> <fp32|bf16|fp16>`` on 2 gloo ranks.

The model has what importers must handle: a weight tied between two modules (DeepSpeed lists it
in ``shared_params``), a frozen parameter (``frozen_param_shapes``/``frozen_param_fragments``),
parameter sizes that do not divide by the world size (ZeRO padding), a WarmupLR scheduler and
client state. Beside the checkpoint, rank 0 writes ``<outdir>/truth.pt``, the ground truth
gathered through DeepSpeed's own public API: the module's weights as it holds them (``model``),
the fp32 master weights (``fp32``) and every Adam moment (``exp_avg``, ``exp_avg_sq``), all full
shape, keyed by parameter name.
"""
import sys

import deepspeed
import torch
import torch.nn as nn
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from statesnap.bench.ds_producer import init_gloo


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(24, 16)
        self.fc1 = nn.Linear(16, 30)
        self.fc2 = nn.Linear(30, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 24, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.norm.weight.requires_grad_(False)  # frozen

    def forward(self, ids):
        return self.head(self.norm(self.fc2(torch.relu(self.fc1(self.emb(ids))))))


def full_state(engine, gather: bool = False) -> dict:
    """The ground truth, on every rank (the gathers are collectives): the module's weights as it
    holds them, the fp32 master weights and the Adam moments, full shape (this rank's TP slice
    under AutoTP), through DeepSpeed's public API."""
    truth = {"model": {}, "fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=gather):
        for name, p in params:
            truth["model"][name] = p.detach().clone()
    for name, p in params:
        if not p.requires_grad:
            continue
        truth["fp32"][name] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            truth[key][name] = safe_get_full_optimizer_state(p, key).clone()
    return truth


def save_with_rank_truths(engine, outdir: str, client_state: dict | None = None) -> None:
    """The checkpoint (``client_state`` added to the client state), and beside it
    ``truth_rank<r>.pt``: each rank's own slices of the truth (tensor- and pipeline-parallel runs,
    where no rank holds everything)."""
    engine.save_checkpoint(outdir, tag="global_step3", client_state={"my_extra": 42, **(client_state or {})})
    torch.save(full_state(engine), f"{outdir}/truth_rank{torch.distributed.get_rank()}.pt")


def main():
    stage, outdir, precision = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    init_gloo()
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "zero_optimization": {"stage": stage},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 10}}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    if precision == "fp16":  # a small dynamic scale, so that no step overflows and is skipped
        cfg[precision]["initial_scale_power"] = 4
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # shard even tiny params
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    for _ in range(3):
        ids = torch.randint(0, 24, (4, 5))
        logits = engine(ids).float()
        loss = nn.functional.cross_entropy(logits.reshape(-1, 24), ids.reshape(-1))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(outdir, tag="global_step3", client_state={"my_extra": 42})

    truth = full_state(engine, gather=stage == 3)
    if torch.distributed.get_rank() == 0:
        torch.save(truth, f"{outdir}/truth.pt")


if __name__ == "__main__":
    from statesnap.bench.teardown import leave_together

    main()
    leave_together()
