"""Trains like `resume_run.resume_fit` with a `last.ckpt` every 6 steps, and dies by SIGKILL (the whole process
group: the main process and both ranks, like a lost node) in the middle of the second save: after rank 0 wrote its
file, before the checkpoint is complete."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.resume_run import resume_fit
from lightning_zoff.checkpoint import rank_files

if __name__ == "__main__":
    out = Path(sys.argv[1])
    real_save, calls = rank_files.write_rank_file, []

    def save_then_die(*args, **kwargs):
        result = real_save(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2 and dist.get_rank() == 0:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        return result

    rank_files.write_rank_file = save_then_die
    resume_fit(out / "run", callbacks=[ModelCheckpoint(dirpath=out / "ck", save_top_k=0, save_last=True,
                                                       every_n_train_steps=6)])
