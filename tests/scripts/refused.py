"""Fits, with the default launcher (Lightning re-runs this script for rank 1), a run zoff refuses: argv[1] names the
mistake and argv[2], where given, the checkpoint to resume from.

- `manual`: manual optimization; `sgd`: an optimizer zoff cannot run; `two`: two optimizers;
- `missing`: a ckpt_path that does not exist; `foreign`: a ckpt_path that is no zoff checkpoint;
- `other`: a zoff checkpoint of another model (known in the ranks only: each rank compares it with its model);
- `rank1`: rank 1 alone fails in its first training step (rank 0 then loses it in a collective).

With `REFUSED_TRACE` naming a file, the script appends a line there for each heavy thing it does: a rank other than 0
started (Lightning re-ran this script for it), a process group joined, a model sharded.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

import lightning.pytorch as pl
import torch

from helpers.tiny import token_loader
from helpers.tiny_module import TinyModule
from lightning_zoff import ZoffStrategy, training

TRACE = os.environ.get("REFUSED_TRACE")


def record(event: str) -> None:
    if TRACE:
        with open(TRACE, "a") as trace:
            trace.write(event + "\n")


def traced(event: str, function):
    def call(*args, **kwargs):
        record(event)
        return function(*args, **kwargs)
    return call


if os.environ.get("LOCAL_RANK", "0") != "0":
    record(f"rank {os.environ['LOCAL_RANK']} started")
torch.distributed.init_process_group = traced("process group", torch.distributed.init_process_group)
training.shard_model = traced("sharded", training.shard_model)


class Refused(TinyModule):
    def __init__(self, mistake: str) -> None:
        super().__init__("sgd" if mistake == "sgd" else "adamw")
        self.mistake = mistake
        self.automatic_optimization = mistake != "manual"

    def training_step(self, batch, batch_idx):
        if self.mistake == "rank1" and self.global_rank == 1:
            raise ValueError("rank 1 cannot go on")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        if self.mistake == "two":
            params = list(self.parameters())
            return [torch.optim.AdamW(params[:2]), torch.optim.AdamW(params[2:])]
        return super().configure_optimizers()


if __name__ == "__main__":
    mistake, ckpt_path = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZoffStrategy(), max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Refused(mistake), token_loader(n=16), ckpt_path=ckpt_path)
