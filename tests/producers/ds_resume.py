"""DeepSpeed trains a tiny MLP, saves, and (with ``--resume``) resumes its own checkpoint for one more step.

``python -m torch.distributed.run --standalone --nproc_per_node=2 ds_resume.py STAGE OUT [--resume]``
(through :func:`producers.run_producer`; ``DS_ACCELERATOR=cpu``, gloo):

1. ZeRO stage ``STAGE``, fp32, a client ``torch.optim.AdamW``: three steps, then
   ``save_checkpoint(OUT, tag="global_step3", client_state={"my_extra": 42})``. Rank 0 writes the
   ground truth ``OUT/truth.pt``: ``{name: {"fp32", "exp_avg", "exp_avg_sq"}}`` as DeepSpeed's own
   ``safe_get_full_*`` helpers gather them (the full, unpadded tensors), and the three losses.
2. ``--resume``: a fresh model (other seed) and optimizer, ``load_checkpoint(OUT)``, one more step
   on the next batch. Rank 0 writes ``OUT/resume.pt``: that batch, the loss of that step and the
   full fp32 weights after it: what a job continuing elsewhere must reproduce.

Every rank trains on the same batch, so the data-parallel gradient average is the gradient of
that one batch, and a continuation on any number of ranks (FSDP2 on 3, TP on 2) can run the same
step on the same batch. DeepSpeed clips gradients to a global norm of 1.0 by default; the
continuation has to do the same (research/producers.md, "Resuming").
"""
from __future__ import annotations

import os
import sys

import torch
from torch import nn

LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
STEPS, BATCH = 3, 4


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of step ``step``, the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 16, generator=gen), torch.randn(BATCH, 8, generator=gen)


def engine_for(stage: int, seed: int):
    import deepspeed

    torch.manual_seed(seed)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train_step(engine, step: int) -> float:
    x, y = batch(step)
    loss = ((engine(x) - y) ** 2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def full_state(engine) -> dict:
    """``{name: {"fp32", "exp_avg", "exp_avg_sq"}}``, gathered by DeepSpeed (a collective: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {name: {"fp32": safe_get_full_fp32_param(p).clone(),
                   "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                   "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()}
            for name, p in engine.module.named_parameters()}


def main(stage: int, out: str, resume: bool) -> None:
    from statesnap.bench.ds_producer import init_gloo

    init_gloo()
    rank = torch.distributed.get_rank()
    engine = engine_for(stage, seed=0)
    losses = [train_step(engine, step) for step in range(STEPS)]
    engine.save_checkpoint(out, tag=f"global_step{STEPS}", client_state={"my_extra": 42})
    truth = full_state(engine)
    if rank == 0:
        torch.save({"params": truth, "losses": losses}, os.path.join(out, "truth.pt"))
    if not resume:
        return
    fresh = engine_for(stage, seed=1)
    fresh.load_checkpoint(out)
    x, y = batch(STEPS)
    loss = train_step(fresh, STEPS)
    weights = {name: parts["fp32"] for name, parts in full_state(fresh).items()}
    if rank == 0:
        torch.save({"x": x, "y": y, "loss": loss, "weights": weights}, os.path.join(out, "resume.pt"))


if __name__ == "__main__":
    from statesnap.bench.teardown import leave_together

    main(int(sys.argv[1]), sys.argv[2], "--resume" in sys.argv[3:])
    leave_together()
