"""A tiny transformer LightningModule and a probe callback shared by the strategy tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zoff.optim
from lightning_zoff.offload.placement import Placement

ACCELERATOR = Placement.ACCELERATOR

VOCAB, DIM, SEQ = 64, 32, 16
# large enough that Adam's update depends on the gradient's scale, so a wrong 1/world or clip factor shows
EPS = 1e-3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).view(*x.shape[:2], 3, 2, DIM // 2).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(x.shape))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, n_blocks: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class TinyModule(LightningModule):
    def __init__(self, optimizer: str = "adamw", lr: float = 3e-3, step_lr: bool = True) -> None:
        super().__init__()
        self.model = TinyLM()
        self.optimizer_name, self.lr, self.step_lr = optimizer, lr, step_lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x).float().flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x).float().flatten(0, 1), y.flatten()), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self.model(x).float().flatten(0, 1), y.flatten()), sync_dist=True)

    def configure_optimizers(self, **torch_hints: bool):
        """`torch_hints`: AdamW's `fused=`/`foreach=`, which choose torch's implementation, not the math."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": self.lr * 2}]
        if self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95), eps=EPS, **torch_hints)
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


def token_loader(n: int = 192, batch_size: int = 4, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    # a learnable pattern: the next token is (token * 3 + 1) mod VOCAB, with 10% noise
    x = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    for t in range(1, SEQ + 1):
        keep = torch.rand(n, generator=g) > 0.1
        x[:, t] = torch.where(keep, (x[:, t - 1] * 3 + 1) % VOCAB, x[:, t])
    return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=batch_size, shuffle=False)


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
            info["planned"] = {"host": engine.plan.host_bytes, "accelerator": engine.plan.state_on(ACCELERATOR)}
            info["state_devices"] = sorted({str(t.device) for u in engine.units for t in u.buffers()})
            info["state_dtypes"] = sorted({str(t.dtype) for u in engine.units for t in u.state})
            info["placements"] = {u.layout.name: u.placement.value for u in engine.units if u.trained}
            info["torch_state_empty"] = all(len(s) == 0 for s in trainer.optimizers[0].state.values())
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(info))


def read_probe(out_dir: Path, rank: int = 0) -> dict:
    return json.loads((Path(out_dir) / f"rank{rank}.json").read_text())
