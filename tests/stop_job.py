"""A callback that stops the main job as a crash would: SIGKILL to the job's processes after a given step."""

from __future__ import annotations

import os
import signal
import time

import lightning.pytorch as pl


class KillAfterStep(pl.Callback):
    """Right after optimizer step `step`, once every rank is past it (the job's own checkpoint of that step included:
    its callback comes before those of the command line), rank 0 sends SIGKILL to its process group: the job's main
    process and its ranks. The job must run in a process group of its own (`start_new_session=True`)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.strategy.barrier()
            if trainer.is_global_zero:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            time.sleep(60)  # the other ranks wait for the signal


class InterruptAfterStep(pl.Callback):
    """Ctrl-C right after optimizer step `step`, as a terminal sends it: SIGINT to the job's process group (the job's
    main process and its ranks), once every rank is past the step. The job must run in a process group of its own."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.strategy.barrier()
            if trainer.is_global_zero:
                os.killpg(os.getpgid(0), signal.SIGINT)
            time.sleep(60)  # the interrupt comes during the sleep, in every rank
