"""The one Trainer fit the strategy tests share: 2 CPU ranks on gloo (forked under `start_method="fork"`), no logger,
progress bar, model summary or checkpoints unless asked for."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from helpers.tiny_module import Probe


def fit(module: pl.LightningModule | Callable[[pl.Trainer], pl.LightningModule], data: Any, strategy: Any, *,
        out: Path | None = None, devices: int = 2, precision: str | None = None, max_steps: int = -1,
        accumulate: int = 1, clip: float | None = None, callbacks: Sequence[pl.Callback] = (), ckpt_path: Any = None,
        weights_only: bool | None = None, **options: Any) -> pl.Trainer:
    """Fit `module` (or what `module(trainer)` builds, under `trainer.init_module` say) on `data`, a DataLoader or a
    LightningDataModule. `out`: the Trainer's root directory, where a `Probe` writes what each rank saw; `precision`:
    the flag (none: 32-true, or what a precision plugin in `options["plugins"]` says); `clip`: the gradient's norm
    clipped to it; `ckpt_path`, `weights_only`: `trainer.fit`'s; `options`: the Trainer's other arguments, over the
    defaults here."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    options = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
               "enable_model_summary": False, **options}
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision=precision,
                         max_steps=max_steps, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                         callbacks=[*([Probe(out)] if out is not None else []), *callbacks], default_root_dir=out,
                         **options)
    if not isinstance(module, pl.LightningModule):
        module = module(trainer)
    if isinstance(data, pl.LightningDataModule):
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path, weights_only=weights_only)
    else:
        trainer.fit(module, data, ckpt_path=ckpt_path, weights_only=weights_only)
    return trainer
