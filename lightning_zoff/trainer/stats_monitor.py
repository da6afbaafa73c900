"""zoff's step breakdown in the Trainer's logger, when the user asks for it: a strategy logs nothing by itself."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_zoff.trainer.strategy import ZoffStrategy


class ZoffStatsMonitor(pl.Callback):
    """Logs the breakdown of each optimizer step that `ZoffStrategy` computes (`trainer.strategy.telemetry`:
    ``zoff/forward_s``, ``zoff/backward_s``, ``zoff/exposed_optimizer_s``, ``zoff/cpu_update_s``, bytes each way, grad
    norm, skips, loss scale, ...) through `LightningModule.log_dict`, as Lightning's `DeviceStatsMonitor` logs device
    stats: every `log_every_n_steps` in the logger, and in `trainer.callback_metrics`. Each rank logs its own, unsynced.
    Under another strategy it logs nothing.

    Example::

        trainer = Trainer(strategy="zoff", callbacks=[ZoffStatsMonitor()])
    """

    def __init__(self) -> None:
        self._last_step = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # a resumed run's first step is the checkpoint's next

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # inside an accumulation window: no step ran
            return
        self._last_step = trainer.global_step
        if isinstance(trainer.strategy, ZoffStrategy) and trainer.strategy.telemetry:
            pl_module.log_dict(trainer.strategy.telemetry, on_step=True, on_epoch=False)
