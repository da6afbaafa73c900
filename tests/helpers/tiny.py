"""The tiny transformer the strategy tests train, its data and its AdamW: plain torch, no Lightning (`tiny_module`
wraps it in a LightningModule)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, DIM, SEQ = 64, 32, 16
# large enough that Adam's update depends on the gradient's scale, so a wrong 1/world or clip factor shows
EPS = 1e-3
LR = 3e-3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).view(*x.shape[:2], 3, 2, DIM // 2).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(x.shape))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, n_blocks: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def param_groups(module: nn.Module, lr: float) -> list[dict]:
    """Weight decay on the matrices; none, and twice the learning rate, on the rest."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": lr * 2}]


def adamw(module: nn.Module, lr: float = LR, **torch_hints: bool) -> torch.optim.AdamW:
    """`torch_hints`: AdamW's `fused=`/`foreach=`, which choose torch's implementation, not the math."""
    return torch.optim.AdamW(param_groups(module, lr), lr=lr, betas=(0.9, 0.95), eps=EPS, **torch_hints)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def token_loader(n: int = 192, batch_size: int = 4, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    # a learnable pattern: the next token is (token * 3 + 1) mod VOCAB, with 10% noise
    x = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    for t in range(1, SEQ + 1):
        keep = torch.rand(n, generator=g) > 0.1
        x[:, t] = torch.where(keep, (x[:, t - 1] * 3 + 1) % VOCAB, x[:, t])
    return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=batch_size, shuffle=False)


# Micro-batch `i` over all ranks: the samples INPUTS[i * GLOBAL : (i + 1) * GLOBAL], split evenly among the ranks, so
# that a run on 2 ranks and one on 3 (or one process) see the same global mean loss and gradient.
GLOBAL = 12
INPUTS, TARGETS = token_loader(n=240).dataset.tensors


def micro_batch(index: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = slice(index * GLOBAL + rank, (index + 1) * GLOBAL, world_size)  # as Lightning's DistributedSampler deals
    return INPUTS[rows], TARGETS[rows]
