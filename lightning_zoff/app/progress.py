"""The progress bar of the main job and the CLI: Lightning's own (Rich's where rich is installed, else TQDM's), counting
the batches this run trains in the epoch.

Lightning's bar counts a batch by its index in the epoch and, with `max_steps` governing (`max_epochs` -1, what the
Trainer sets when only `max_steps` is given), sizes the epoch to the steps left: a run resumed at batch 119 of its
epoch with 19 steps to go reads `120/19`, and Rich's title reads `Epoch 0/-2`. These bars end the count at the batch
where training stops (`60/60` resumed at batch 41 of 60, not `60/59`), and title the epoch without a last epoch when
there is none.
"""

from __future__ import annotations

from typing import Any, cast

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from lightning.pytorch.loops.progress import _ProcessedTracker
from lightning_utilities.core.imports import RequirementCache
from typing_extensions import override


class _CountsThisRun(ProgressBar):
    @property
    @override
    def total_train_batches(self) -> int | float:
        trainer = self.trainer
        total = trainer.num_training_batches
        if trainer.max_steps > 0:
            # A resumed epoch counts on from the batches its checkpoint had done (until the loop resets them), and a
            # bar sized at a batch's end (resumed mid-epoch, Lightning calls no on_train_epoch_start) from that batch:
            # processed, not completed, which the loop counts after on_train_batch_end (`60/59` otherwise). Of an
            # accumulation window under way, its batches processed are part of the steps left.
            epoch_loop = trainer.fit_loop.epoch_loop
            current = cast(_ProcessedTracker, epoch_loop.batch_progress.current)  # typed as its base class
            done = current.processed if epoch_loop.restarting else 0
            accumulate = trainer.accumulate_grad_batches
            left = (trainer.max_steps - trainer.global_step) * accumulate - done % accumulate
            total = min(total, done + left)
        return total


class RichStepsBar(_CountsThisRun, RichProgressBar):
    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs != -1:
            return super()._get_train_description(current_epoch)
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"  # padded as Rich's


class TQDMStepsBar(_CountsThisRun, TQDMProgressBar):  # titled "Epoch N" already
    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self.is_disabled and self.train_progress_bar.total is None:
            # resumed mid-epoch: Lightning calls no on_train_epoch_start, where TQDM's bar is sized (Rich's is here)
            self.train_progress_bar.total = convert_inf(self.total_train_batches)
        super().on_train_batch_end(trainer, *args)


def progress_bar() -> pl.Callback:
    return RichStepsBar() if RequirementCache("rich") else TQDMStepsBar()
