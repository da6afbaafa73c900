"""The step count of a resumed fit when the checkpoint was written by Fabric's door (`fabric.save`, in the Trainer's
layout: `lightning_zoff.fabric.checkpoints`). Such a checkpoint holds no state of the Trainer's loops (``loops``): a
Fabric loop keeps its own count, which `scripts/train_fabric.py` saves as ``global_step``, the key under which the
Trainer's own checkpoints hold theirs. The fit continues from that count; a checkpoint with neither is refused, where
Lightning would silently train every step again from step 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.loops import _FitLoop


def fabric_step_count(checkpoint: dict[str, Any], path: Path | str) -> int | None:
    """The step a fit resumed from `checkpoint` starts at, when Fabric wrote it (no ``loops``); None for the
    Trainer's own. Refuses (ValueError, one line) a checkpoint that holds neither loops nor a step count."""
    if "loops" in checkpoint:
        return None
    step = checkpoint.get("global_step")
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        return step
    raise ValueError(
        f"{path}: holds no step count (neither the Trainer's 'loops' nor a 'global_step', as fabric.save writes it"
        f" from {{..., 'global_step': step}}): resumed, the fit would train every step again from step 0. Save the"
        " step under 'global_step', or load the weights alone (strategy.load_full_state_dict(path) in on_fit_start)."
    )


def continue_step_count(fit_loop: _FitLoop, step: int) -> None:
    """Start `fit_loop` at optimizer step `step` (`trainer.global_step`, what `max_steps` and the loggers count) at the
    start of an epoch: the data of a Fabric loop's position is not the Trainer's to restore."""
    epoch_loop = fit_loop.epoch_loop
    for progress in (epoch_loop.automatic_optimization.optim_progress.optimizer.step.total,
                     epoch_loop.manual_optimization.optim_step_progress.total):
        progress.ready = progress.completed = step
    epoch_loop._batches_that_stepped = step  # the loggers' step
