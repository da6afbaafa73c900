"""`Trainer(sync_batchnorm=True)` on one GPU: the BatchNorm layers train as SyncBatchNorm under zoff, and (one rank:
nothing to synchronise) as BatchNorm does."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from helpers.batchnorm import NormClassifier, norm_loader
from lightning_zoff import ZoffStrategy


def train(sync: bool) -> NormClassifier:
    pl.seed_everything(0)
    module = NormClassifier()
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=ZoffStrategy(), precision="32-true", max_steps=6,
                         sync_batchnorm=sync, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module, norm_loader())
    return module


def test_sync_batchnorm_trains_with_synced_layers_on_one_gpu():
    synced, plain = train(True), train(False)
    assert synced.norm_classes == {"SyncBatchNorm"}
    assert plain.norm_classes == {"BatchNorm1d"}
    torch.testing.assert_close(torch.tensor(synced.losses), torch.tensor(plain.losses), rtol=1e-5, atol=1e-6)
