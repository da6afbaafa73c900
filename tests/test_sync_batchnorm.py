"""`Trainer(sync_batchnorm=True)`: Lightning hands the strategy its layer sync; zoff applies it before sharding on
GPUs (tests/gpu/test_sync_batchnorm_gpu.py) and refuses it in one line on CPU ranks, where torch's SyncBatchNorm
cannot run, before any rank starts."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from helpers.batchnorm import NormClassifier, norm_loader
from lightning_zoff import ZoffStrategy


def test_sync_batchnorm_on_cpu_ranks_is_refused_before_they_start(capfd):
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZoffStrategy(start_method="fork"), max_steps=2,
                         sync_batchnorm=True, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"^sync_batchnorm=True: torch's SyncBatchNorm synchronises batch statistics on"
                                         r" GPUs only, .* Use sync_batchnorm=False there"):
        trainer.fit(NormClassifier(), norm_loader())
    assert "Initializing distributed" not in capfd.readouterr().err  # no rank started
