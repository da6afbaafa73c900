"""The training run the checkpoint tests interrupt and resume: 2 epochs of 6 optimizer steps on 2 ranks."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch

from helpers.tiny import token_loader
from helpers.tiny_module import TinyModule, read_probe
from helpers.trainer import fit
from lightning_zoff import ZoffStrategy

SAMPLES = 48  # 6 batches of 4 per rank and epoch: 6 optimizer steps


def resume_fit(out: Path, *, devices: int = 2, batch_size: int = 4, ckpt_path=None, callbacks=(), plugins=(),
               max_steps: int = 12, module: pl.LightningModule | None = None, num_nodes: int = 1,
               **strategy_kw) -> dict:
    """Fit (or resume) and return what rank 0 saw (see `Probe`)."""
    out = Path(out)
    pl.seed_everything(7)
    module = module or TinyModule()
    strategy_kw.setdefault("start_method", "fork")
    fit(module, token_loader(n=SAMPLES, batch_size=batch_size), ZoffStrategy(**strategy_kw), out=out, devices=devices,
        max_steps=max_steps, clip=0.84, callbacks=callbacks, ckpt_path=ckpt_path, num_nodes=num_nodes,
        plugins=list(plugins), enable_checkpointing=True)
    if num_nodes > 1:
        return {}  # each node wrote its own ranks' probes; the caller reads them once every node is done
    return {rank: read_probe(out, rank) for rank in range(devices)}


class SaveBatch(pl.Callback):
    """Saves the batch each rank trains on at optimizer step `step` to `out/batch{rank}.pt`."""

    def __init__(self, step: int, out: Path) -> None:
        self.step, self.out = step, Path(out)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            torch.save([t.cpu() for t in batch], self.out / f"batch{trainer.global_rank}.pt")
