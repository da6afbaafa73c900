"""The main job's progress bar (`lightning_zoff.app.progress`) counts the batches this run trains: right after a
resume too. One process, Lightning's own strategy: the bar is the application's, whatever the strategy."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

import helpers.trainer
from helpers.tiny import token_loader
from helpers.tiny_module import TinyModule
from lightning_zoff.app.progress import RichStepsBar, TQDMStepsBar


class BarAtEnd(pl.Callback):
    """The bar's count and total after the last batch (before the bar closes)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        bar = next(c for c in trainer.callbacks if isinstance(c, (TQDMStepsBar, RichStepsBar)))
        if isinstance(bar, TQDMStepsBar):
            self.n, self.total = bar.train_progress_bar.n, bar.train_progress_bar.total
        else:
            task = bar.progress.tasks[bar.train_progress_bar_id]
            self.n, self.total = int(task.completed), int(task.total)


def fit(tmp_path, bar, max_steps, accumulate, ckpt_path=None) -> BarAtEnd:
    seen = BarAtEnd()
    # a checkpoint every 3 steps, saved in on_train_batch_end (as the main job's last.ckpt), mid-epoch (16 batches)
    every3 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    helpers.trainer.fit(TinyModule(step_lr=False), token_loader(n=64), "auto", devices=1, max_steps=max_steps,
                        accumulate=accumulate, callbacks=[bar(), every3, seen], ckpt_path=ckpt_path,
                        enable_checkpointing=True, enable_progress_bar=True, limit_val_batches=0,
                        num_sanity_val_steps=0)
    return seen


@pytest.mark.parametrize("bar", [TQDMStepsBar, RichStepsBar])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_bar_total_right_after_a_resume_is_where_training_stops(tmp_path, bar, accumulate):
    first = fit(tmp_path, bar, 3, accumulate)
    assert (first.n, first.total) == (3 * accumulate, 3 * accumulate)
    resumed = fit(tmp_path, bar, 5, accumulate, ckpt_path=tmp_path / "epoch=0-step=3.ckpt")
    # the epoch's batches up to step 5: `5/4` before (Rich), `5/?` (TQDM, never sized)
    assert (resumed.n, resumed.total) == (5 * accumulate, 5 * accumulate)
