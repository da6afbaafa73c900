"""zoff's step breakdown reaches the user's logger only through the callback the user adds (`ZoffStatsMonitor`), as
Lightning's own strategies log nothing by themselves (`DeviceStatsMonitor` is the convention); once per optimizer
step, not per micro-batch."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from helpers.tiny import token_loader
from helpers.tiny_module import TinyModule
from helpers.trainer import fit
from lightning_zoff import ZoffStatsMonitor, ZoffStrategy


class LogsItsLoss(TinyModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def fit_logged(tmp_path, callbacks=()) -> tuple[pl.Trainer, list[dict[str, str]]]:
    pl.seed_everything(1)
    logger = CSVLogger(tmp_path, name="logs")
    trainer = fit(LogsItsLoss(), token_loader(n=12, batch_size=2), ZoffStrategy(start_method="fork"), devices=1,
                  max_steps=3, accumulate=2, callbacks=callbacks, logger=logger, log_every_n_steps=1)
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as rows:
        return trainer, list(csv.DictReader(rows))


def test_the_strategy_logs_nothing_by_itself(tmp_path):
    trainer, rows = fit_logged(tmp_path)
    assert [row for row in rows if row["train_loss"]]  # the module's own metric is there
    assert not [key for key in rows[0] if key.startswith("zoff/")]
    assert not [key for key in trainer.callback_metrics if key.startswith("zoff/")]


def test_the_monitor_logs_each_optimizer_step(tmp_path):
    trainer, rows = fit_logged(tmp_path, [ZoffStatsMonitor()])
    keys = {"zoff/forward_s", "zoff/backward_s", "zoff/exposed_optimizer_s", "zoff/cpu_update_s", "zoff/d2h_gb",
            "zoff/h2d_gb", "zoff/grad_norm"}
    assert keys <= rows[0].keys()
    assert len([row for row in rows if row["zoff/forward_s"]]) == 3  # 3 steps of 2 micro-batches each
    assert keys <= trainer.callback_metrics.keys()
