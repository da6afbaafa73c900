"""The progress bar of the main job and the CLI: Lightning's own (Rich's where rich is installed, else TQDM's), counting
the batches this run trains in the epoch.

Lightning's bar counts a batch by its index in the epoch and, with `max_steps` governing (`max_epochs` -1, what the
Trainer sets when only `max_steps` is given), sizes the epoch to the steps left: a run resumed at batch 119 of its
epoch with 19 steps to go reads `120/19`, and Rich's title reads `Epoch 0/-2`. These bars end the count at the batch
where training stops, and title the epoch without a last epoch when there is none.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning_utilities.core.imports import RequirementCache
from typing_extensions import override


class _CountsThisRun(ProgressBar):
    @property
    @override
    def total_train_batches(self) -> int | float:
        trainer = self.trainer
        total = trainer.num_training_batches
        if trainer.max_steps > 0:
            # a resumed epoch counts on from the batches its checkpoint had done (until the loop resets them)
            epoch_loop = trainer.fit_loop.epoch_loop
            done = epoch_loop.batch_progress.current.completed if epoch_loop.restarting else 0
            left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
            total = min(total, done + left)
        return total


class RichStepsBar(_CountsThisRun, RichProgressBar):
    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs != -1:
            return super()._get_train_description(current_epoch)
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"  # padded as Rich's


class TQDMStepsBar(_CountsThisRun, TQDMProgressBar):
    pass  # titled "Epoch N" already


def progress_bar() -> pl.Callback:
    return RichStepsBar() if RequirementCache("rich") else TQDMStepsBar()
