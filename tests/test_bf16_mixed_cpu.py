"""precision="bf16-mixed" on CPU ranks: a model whose LayerNorms get fp32 inputs (features straight from the batch)
trains under zoff as under DDP. CPU autocast runs `layer_norm` in the input's dtype, next to zoff's bf16 shards."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import helpers.trainer
from helpers.tiny_module import read_probe
from lightning_zoff import ZoffStrategy

DIM, CLASSES = 32, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.mlp(self.norm(x)))


class Classifier(pl.LightningModule):
    """README's quick-start model: the first block's LayerNorm gets the fp32 batch."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, CLASSES)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        for block in self.blocks:
            x = block(x)
        loss = F.cross_entropy(self.head(self.norm(x)), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


def fit(out, strategy) -> dict:
    pl.seed_everything(3)
    x = torch.randn(256, DIM, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x[:, :CLASSES].argmax(dim=1)), batch_size=16)
    helpers.trainer.fit(Classifier(), data, strategy, out=out, precision="bf16-mixed", max_steps=8, clip=1.0)
    return read_probe(out)


def test_bf16_mixed_trains_layer_norms_on_fp32_inputs_as_ddp_does(tmp_path):
    ddp = fit(tmp_path / "ddp", DDPStrategy(start_method="fork"))
    zoff = fit(tmp_path / "zoff", ZoffStrategy(start_method="fork"))
    assert zoff["param_dtypes"] == ["torch.bfloat16"]  # 16-bit shards; DDP keeps fp32 weights under autocast
    assert ddp["param_dtypes"] == ["torch.float32"]
    assert len(zoff["losses"]) == len(ddp["losses"]) == 8
    # the same autocast matmuls; the LayerNorms' weights and inputs rounded to bf16 under zoff (measured: 1.3e-3)
    errors = [abs(a - b) / b for a, b in zip(zoff["losses"], ddp["losses"], strict=True)]
    assert max(errors) < 5e-3, errors
    assert zoff["losses"][-1] < zoff["losses"][0] - 0.1  # it learns, so the comparison means something
