"""The tiny transformer (`tiny`) as a LightningModule, and a probe callback shared by the strategy tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule

import lightning_zoff.optim
from helpers.tiny import EPS, LR, TinyLM, adamw, loss_of, param_groups
from lightning_zoff.placement import Placement

ACCELERATOR = Placement.ACCELERATOR


class TinyModule(LightningModule):
    def __init__(self, optimizer: str = "adamw", lr: float = LR, step_lr: bool = True) -> None:
        super().__init__()
        self.model = TinyLM()
        self.optimizer_name, self.lr, self.step_lr = optimizer, lr, step_lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.model, *batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", loss_of(self.model, *batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", loss_of(self.model, *batch), sync_dist=True)

    def configure_optimizers(self, **torch_hints: bool):
        """`torch_hints`: AdamW's `fused=`/`foreach=` (`tiny.adamw`)."""
        groups = param_groups(self, self.lr)
        if self.optimizer_name == "adamw":
            opt = adamw(self, self.lr, **torch_hints)  # over the same groups
        elif self.optimizer_name == "adam":
            opt = torch.optim.Adam(groups, lr=self.lr, eps=EPS)
        elif self.optimizer_name == "lion":
            opt = lightning_zoff.optim.Lion(groups, lr=self.lr / 3, betas=(0.9, 0.99))
        elif self.optimizer_name == "sgd":
            opt = torch.optim.SGD(groups, lr=self.lr)
        else:
            raise ValueError(self.optimizer_name)
        if not self.step_lr:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Probe(Callback):
    """Writes what each rank saw (micro-batch losses, memory report, dtypes) to `out_dir/rank{r}.json`."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.clip_coefs: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        last = getattr(trainer.strategy, "last_step", None)
        if last is not None and len(self.clip_coefs) < trainer.global_step:
            self.clip_coefs.append(last.clip_coef)

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        engine = getattr(strategy, "engine", None)
        info = {
            "losses": pl_module.losses,
            "world_size": trainer.world_size,
            "param_dtypes": sorted({str(p.dtype) for p in pl_module.parameters()}),
            "num_params": sum(p.numel() for p in pl_module.parameters()),
            "lr": [g["lr"] for g in trainer.optimizers[0].param_groups],
            "clip_coefs": self.clip_coefs,
            "telemetry": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("zoff/")},
        }
        if engine is not None:
            engine.wait_idle()
            info["memory"] = engine.memory_report()
            info["held"] = engine.held_bytes()  # what its tensors hold, per side
            info["planned"] = {"host": engine.plan.host_bytes, "accelerator": engine.plan.state_on(ACCELERATOR),
                               "lending": engine.plan.lending_bytes}
            info["state_devices"] = sorted({str(t.device) for u in engine.units for t in u.buffers()})
            info["state_dtypes"] = sorted({str(t.dtype) for u in engine.units for t in u.state})
            info["placements"] = {u.layout.name: u.placement.value for u in engine.units if u.trained}
            info["torch_state_empty"] = all(len(s) == 0 for s in trainer.optimizers[0].state.values())
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(info))


def read_probe(out_dir: Path, rank: int = 0) -> dict:
    return json.loads((Path(out_dir) / f"rank{rank}.json").read_text())
