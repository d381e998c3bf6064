"""A small GPT-like model, deterministic synthetic data and one training step, all on the CPU.

The demo and the training benchmark share this so that both measure the same workload: a
decoder-only transformer trained with AdamW, whose checkpoint is the model plus two optimizer
moments per parameter (3 x 4 bytes per parameter). The data is a function of the step number
alone, so a run resumed at step N sees exactly the batches an uninterrupted run would have seen.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

HEAD_DIM = 64
STATE_BYTES_PER_PARAM = 12  # float32 parameter + AdamW exp_avg + exp_avg_sq


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 512
    d_model: int = 128
    n_layer: int = 2
    seq_len: int = 64
    batch: int = 8

    @property
    def n_head(self) -> int:
        return max(1, self.d_model // HEAD_DIM)

    def n_params(self) -> int:
        d, v = self.d_model, self.vocab
        block = 12 * d * d + 13 * d  # qkv + proj + 4x MLP weights and biases, two LayerNorms
        return self.n_layer * block + 2 * v * d + self.seq_len * d + 2 * d

    def state_bytes(self) -> int:
        """Bytes of model + AdamW state (what one checkpoint holds)."""
        return self.n_params() * STATE_BYTES_PER_PARAM

    def to_dict(self) -> dict:
        return asdict(self)


def config_for_state_gb(gb: float, n_layer: int = 8, vocab: int = 8192, seq_len: int = 128,
                        batch: int = 4) -> GPTConfig:
    """A config whose model + AdamW state is about ``gb`` GB (width grows, depth is fixed)."""
    target = gb * 1e9 / STATE_BYTES_PER_PARAM
    a, b = 12 * n_layer, 2 * vocab + seq_len + 13 * n_layer
    d = (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
    d_model = max(HEAD_DIM, int(round(d / HEAD_DIM)) * HEAD_DIM)
    return GPTConfig(vocab=vocab, d_model=d_model, n_layer=n_layer, seq_len=seq_len, batch=batch)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build(cfg: GPTConfig, seed: int = 0, lr: float = 3e-3) -> tuple[GPT, torch.optim.AdamW]:
    """The model and its optimizer, initialised from ``seed`` (the same bits on every run)."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def batch(cfg: GPTConfig, step: int, seed: int = 0) -> torch.Tensor:
    """Step ``step``'s token batch: noisy arithmetic sequences, so the loss has something to learn.

    Drawn from a generator seeded by (seed, step) only: independent of what ran before.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(cfg.vocab, (cfg.batch, 1), generator=gen)
    stride = torch.randint(1, 8, (cfg.batch, 1), generator=gen)
    tokens = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab
    noise = torch.rand(tokens.shape, generator=gen) < 0.05
    return torch.where(noise, torch.randint(cfg.vocab, tokens.shape, generator=gen), tokens)


def train_step(model: GPT, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    """One forward, backward and optimizer step; returns the loss before the update."""
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def init_optimizer_state(model: GPT, optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's moments without a forward pass (for benchmarks that only need the state)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
