"""A callback that stops the main job as a crash would: SIGKILL to the job's processes after a given step."""

from __future__ import annotations

import os
import signal
import time

import lightning.pytorch as pl


class SignalAfterStep(pl.Callback):
    """Right after optimizer step `step`, once every rank is past it (the job's own checkpoint of that step included:
    its callback comes before those of the command line), rank 0 sends the signal `sent` to its process group: the
    job's main process and its ranks. The job must run in a process group of its own (`start_new_session=True`)."""

    sent = signal.SIGKILL

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.strategy.barrier()
            if trainer.is_global_zero:
                os.killpg(os.getpgid(0), self.sent)
            time.sleep(60)  # the signal comes during the sleep, in every rank


class KillAfterStep(SignalAfterStep):
    """As a crash would: SIGKILL."""


class InterruptAfterStep(SignalAfterStep):
    """Ctrl-C, as a terminal sends it: SIGINT."""

    sent = signal.SIGINT
