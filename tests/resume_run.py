"""The training run the checkpoint tests interrupt and resume: 2 epochs of 6 optimizer steps on 2 ranks."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_zoff import ZoffStrategy
from tiny import Probe, TinyModule, read_probe, token_loader

SAMPLES = 48  # 6 batches of 4 per rank and epoch: 6 optimizer steps


def resume_fit(out: Path, *, devices: int = 2, batch_size: int = 4, ckpt_path=None, callbacks=(), plugins=(),
               max_steps: int = 12, module: pl.LightningModule | None = None, num_nodes: int = 1,
               **strategy_kw) -> dict:
    """Fit (or resume) and return what rank 0 saw (see `Probe`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(7)
    module = module or TinyModule()
    strategy_kw.setdefault("start_method", "fork")
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=ZoffStrategy(**strategy_kw),
        plugins=list(plugins), max_steps=max_steps, gradient_clip_val=0.84,
        callbacks=[Probe(out), *callbacks], logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(module, token_loader(n=SAMPLES, batch_size=batch_size), ckpt_path=ckpt_path)
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
