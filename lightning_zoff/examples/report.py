"""What the example run shows at its end: a loss curve and zoff's step breakdown (rank 0's view)."""

from __future__ import annotations

import statistics
from pathlib import Path

import lightning.pytorch as pl
import torch
from matplotlib.figure import Figure
from typing_extensions import override


class LossHistory(pl.Callback):
    """Rank 0's training loss every step and the (all-reduced) validation loss after each validation."""

    def __init__(self) -> None:
        self.train: list[tuple[int, torch.Tensor]] = []
        self.val: list[tuple[int, float]] = []

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            # kept as a tensor: .item() here would synchronize with the GPU every step
            self.train.append((trainer.global_step, outputs["loss"].detach()))

    @override
    def on_validation_end(self, trainer, pl_module):
        if trainer.is_global_zero and not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            self.val.append((trainer.global_step, trainer.callback_metrics["val_loss"].item()))

    @override
    def state_dict(self) -> dict:
        # in the checkpoint (rank 0's, which holds the history), so a resumed run plots the whole curve
        return {"train": [(step, float(loss)) for step, loss in self.train], "val": list(self.val)}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.train = [(step, torch.tensor(loss)) for step, loss in state_dict["train"]]
        self.val = [tuple(point) for point in state_dict["val"]]

    def plot(self, path: Path) -> None:
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        if self.train:
            steps, losses = zip(*self.train, strict=True)
            ax.plot(steps, torch.stack(losses).float().cpu(), label="train (rank 0)", linewidth=0.8)
        if self.val:
            ax.plot(*zip(*self.val, strict=True), "o-", label="val")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.savefig(path, dpi=120, bbox_inches="tight")


class StepBreakdown(pl.Callback):
    """Collects the `zoff/*` metrics ZoffStrategy logs at every optimizer step, on rank 0, for a summary."""

    PHASES = ("forward", "backward", "exposed_optimizer")

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._last_step = 0

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # inside an accumulation window the global step stands still and nothing new was logged
        if not trainer.is_global_zero or trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        metrics = {
            k.removeprefix("zoff/"): float(v) for k, v in trainer.callback_metrics.items() if k.startswith("zoff/")
        }
        if metrics:
            self.steps.append(metrics)

    def summary(self) -> str:
        if not self.steps:
            return "step breakdown: none (only strategy=zoff / zoff_no_offload log one)"
        # the first step also builds buffers and (once per machine) the CPU kernels
        steps = self.steps[1:] or self.steps
        mean = {key: statistics.fmean(step[key] for step in steps) for key in steps[0]}
        total = sum(mean[f"{phase}_s"] for phase in self.PHASES) or 1.0
        first, last = len(self.steps) - len(steps) + 1, len(self.steps)
        span = f"step {last}" if first == last else f"steps {first}-{last}, mean per step"
        lines = [f"step breakdown (rank 0, {span}):"]
        lines += [f"  {phase.replace('_', ' '):<18} {mean[f'{phase}_s']:8.4f} s  {mean[f'{phase}_s'] / total:4.0%}"
                  for phase in self.PHASES]
        lines.append(f"  {'cpu update':<18} {mean['cpu_update_s']:8.4f} s  (the CPU's update time)")
        lines.append(f"  {'host traffic':<18} {mean['d2h_gb']:.4f} GB down, {mean['h2d_gb']:.4f} GB up per step")
        return "\n".join(lines)
