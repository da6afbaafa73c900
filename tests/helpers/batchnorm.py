"""A small classifier whose blocks hold BatchNorm layers: the Lightning module of the sync_batchnorm tests."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class NormBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(dim, dim), nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.norm(self.linear(x)))


class NormClassifier(pl.LightningModule):
    def __init__(self, dim: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(NormBlock(dim) for _ in range(2))
        self.head = nn.Linear(dim, classes)
        self.losses: list[float] = []
        self.norm_classes: set[str] = set()  # the classes of the norm layers as training saw them

    def training_step(self, batch, batch_idx):
        x, y = batch
        for block in self.blocks:
            x = block(x)
        loss = F.cross_entropy(self.head(x).float(), y)
        self.losses.append(loss.item())
        self.norm_classes |= {type(block.norm).__name__ for block in self.blocks}
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def norm_loader(n: int = 256, dim: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g) * 3 + 1
    return DataLoader(TensorDataset(x, x[:, :4].argmax(dim=1)), batch_size=32)
