"""A LightningModule laid out as nanoGPT's `GPT` (karpathy/nanoGPT, model.py): its blocks in
`transformer = nn.ModuleDict(wte, wpe, drop, h=ModuleList, ln_f)` beside `lm_head`, the embedding's weight tied to the
head's across those two top-level children. Written for these tests (the layout, not nanoGPT's code)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from helpers.tiny import DIM, SEQ, VOCAB


class CausalSelfAttention(nn.Module):
    def __init__(self, n_head: int = 2) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn, self.c_proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(DIM), CausalSelfAttention()
        self.ln_2, self.mlp = nn.LayerNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(LightningModule):
    """`tie`: `transformer.wte.weight = lm_head.weight`, as nanoGPT does."""

    def __init__(self, tie: bool = True, n_layer: int = 3, lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, DIM),
            wpe=nn.Embedding(SEQ, DIM),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList(Block() for _ in range(n_layer)),
            ln_f=nn.LayerNorm(DIM),
        ))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.transformer.wte.weight = self.lm_head.weight
        for module in self.modules():  # nanoGPT's init
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # and its scaled init of the residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        self.losses: list[float] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).float().flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        # nanoGPT's groups: matrices decay, vectors do not (named_parameters lists a tied weight once)
        params = dict(self.named_parameters())
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95), eps=1e-3)
