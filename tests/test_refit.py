"""fit -> validate -> fit in the same rank processes: the second fit trains with the optimizer its
`configure_optimizers` returns (fresh state, its own param groups, maybe another class), as under every Lightning
strategy, starting from the fp32 master weights the first fit left."""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import threading
import weakref
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.fsdp import FSDPModule

import lightning_zoff.optim
from helpers.compare import rel_err
from helpers.tiny import EPS, token_loader
from helpers.tiny_module import TinyModule, read_probe
from lightning_zoff import ZoffStrategy
from test_training import fit


def in_ranks(fn, *args) -> None:
    """Run `fn(rank, *args)` in 2 forked processes started as a cluster starts ranks (LOCAL_RANK set): the Trainer
    launches nothing, so its later calls run in these same processes, after what the earlier ones left. (Lightning's
    fork launcher forks anew for every call and refuses a second `fit`.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_as_rank, args=(port, fn, args), nprocs=2, start_method="fork")


def _as_rank(rank: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(rank))
    fn(rank, *args)


class Refit(TinyModule):
    """Notes each fit's optimizer. `optimizer_name`: also "lion_by_block" (Lion over other param groups than
    TinyModule's) and "adamw_blocks" (AdamW over the blocks only: the other parameters have no host state)."""

    def __init__(self) -> None:
        super().__init__()
        self.fits: list[dict] = []
        self.previous_optimizer = None

    def configure_optimizers(self):
        if self.optimizer_name == "adamw_blocks":
            return torch.optim.AdamW(self.model.blocks.parameters(), lr=self.lr, betas=(0.9, 0.95), eps=EPS)
        if self.optimizer_name != "lion_by_block":
            return super().configure_optimizers()
        blocks = list(self.model.blocks.parameters())
        in_blocks = {id(p) for p in blocks}
        rest = [p for p in self.parameters() if id(p) not in in_blocks]
        groups = [{"params": blocks, "lr": 1e-3}, {"params": [p for p in rest if p.dim() >= 2], "lr": 2e-3},
                  {"params": [p for p in rest if p.dim() < 2], "lr": 2e-3, "weight_decay": 0.0}]
        return lightning_zoff.optim.Lion(groups, betas=(0.9, 0.99), weight_decay=0.1)

    def on_train_start(self):
        optimizer = self.trainer.optimizers[0]
        self.fits.append({"optimizer": type(optimizer).__name__, "groups": len(optimizer.param_groups),
                          "new_optimizer": optimizer is not self.previous_optimizer,
                          "state_at_start": len(optimizer.state)})
        self.previous_optimizer = optimizer

    def on_train_end(self):
        self.fits[-1]["state_at_end"] = len(self.trainer.optimizers[0].state)


def fit_validate_fit(rank: int, out: Path, strategy_class, first_optimizer: str, second_optimizer: str) -> None:
    module = Refit()
    module.optimizer_name = first_optimizer
    trainer, _ = fit(out, strategy_class(), max_steps=4, module=module)
    trainer.validate(module, token_loader(n=16, seed=1), verbose=False)
    module.optimizer_name = second_optimizer
    trainer.fit_loop.epoch_loop.max_steps = 8
    trainer.fit(module, token_loader())
    (out / f"fits{rank}.json").write_text(json.dumps(module.fits))


@pytest.mark.slow
@pytest.mark.parametrize(("first_optimizer", "second_optimizer"),
                         [("adamw", "adamw"), ("adamw", "lion_by_block"), ("adamw_blocks", "adamw")])
def test_second_fit_trains_like_ddp_with_a_fresh_optimizer(tmp_path, first_optimizer, second_optimizer):
    runs = {}
    for name, strategy_class in (("ddp", DDPStrategy), ("zoff", ZoffStrategy)):
        out = tmp_path / name
        out.mkdir()
        in_ranks(fit_validate_fit, out, strategy_class, first_optimizer, second_optimizer)
        runs[name] = read_probe(out), json.loads((out / "fits0.json").read_text())
    (zoff, zoff_fits), (ddp, ddp_fits) = runs["zoff"], runs["ddp"]
    # the reference: DDP's second fit steps a new torch optimizer that starts without state
    first, second = ddp_fits
    assert first["state_at_end"] > 0
    assert second["new_optimizer"]
    assert second["state_at_start"] == 0
    expected = ("AdamW", 2) if second_optimizer == "adamw" else ("Lion", 3)
    assert (second["optimizer"], second["groups"]) == expected == (zoff_fits[1]["optimizer"], zoff_fits[1]["groups"])
    assert len(zoff["losses"]) == len(ddp["losses"]) == 16  # 8 steps x 2 micro-batches, half of them in each fit
    assert rel_err(zoff["losses"], ddp["losses"]) < 1e-5
    assert zoff["lr"] == ddp["lr"]


class KeepMasters(pl.Callback):
    """The gathered fp32 masters at the start and at the end of every fit."""

    def __init__(self) -> None:
        self.at_start: list[dict] = []
        self.at_end: list[dict] = []

    def on_fit_start(self, trainer, pl_module):
        self.at_start.append(trainer.strategy.full_state_dict())

    def on_train_end(self, trainer, pl_module):
        self.at_end.append(trainer.strategy.full_state_dict())


def refit_bf16(rank: int, out: Path) -> None:
    def workers() -> int:
        return sum(t.name == "zoff-host-worker" and t.is_alive() for t in threading.enumerate())

    def gate_hooks(module) -> list[int]:  # forward pre-hooks per unit: FSDP2's own and, while training, the engine's
        return [len(m._forward_pre_hooks) for m in module.modules() if isinstance(m, FSDPModule)]

    class Training(pl.Callback):  # what a fit looks like while it trains
        def on_train_end(self, trainer, pl_module):
            self.workers, self.hooks, self.interval = workers(), gate_hooks(pl_module), sys.getswitchinterval()

    interval = sys.getswitchinterval()
    masters, training = KeepMasters(), Training()
    trainer, module = fit(out, ZoffStrategy(), precision="bf16-mixed", max_steps=2, callbacks=[masters, training])
    hooks_after_first = gate_hooks(module)
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(module, token_loader())
    kept = masters.at_end[0]
    result = {
        "masters_carried": all(torch.equal(masters.at_start[1][k], v) for k, v in kept.items()),
        # the masters hold more than their 16-bit copies on the accelerator, so carrying those would show
        "masters_beyond_bf16": any(not torch.equal(v, v.bfloat16().float()) for v in kept.values()),
        "trained_on": any(not torch.equal(masters.at_end[1][k], v) for k, v in kept.items()),
        "workers_while_training": training.workers,
        "interval_lowered_while_training": training.interval < interval,
        # the strategy's teardown ended the engine's thread, removed its gates and restored the switch interval
        "workers_after_fit": workers(),
        "hooks_removed": gate_hooks(module) == hooks_after_first == [n - 1 for n in training.hooks],
        "interval_restored": sys.getswitchinterval() == interval,
    }
    # the state stays for trainer.save_checkpoint after fit, and leaves with the Trainer (the model refers to it)
    master = weakref.ref(trainer.strategy.engine.units[0].master)
    trainer.save_checkpoint(out / "after_fit.ckpt")  # collective: the same path on every rank
    held_after_fit = master() is not None
    del trainer, module, masters, training
    gc.collect()
    result |= {"state_held_after_fit": held_after_fit, "buffers_released": master() is None}
    (out / f"refit{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_second_fit_starts_from_the_fp32_masters_and_releases_the_first_engine(tmp_path):
    in_ranks(refit_bf16, tmp_path)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"refit{rank}.json").read_text())
        assert result == {"masters_carried": True, "masters_beyond_bf16": True, "trained_on": True,
                          "workers_while_training": 1, "interval_lowered_while_training": True,
                          "workers_after_fit": 0, "hooks_removed": True, "interval_restored": True,
                          "state_held_after_fit": True, "buffers_released": True}, rank


def fit_another_module(rank: int, out: Path) -> None:
    masters = KeepMasters()
    trainer, _ = fit(out, ZoffStrategy(), max_steps=2, callbacks=[masters])
    torch.manual_seed(1)
    other = TinyModule()
    initial = {k: v.clone() for k, v in other.state_dict().items()}
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(other, token_loader())
    same = all(torch.equal(masters.at_start[1][k], v) for k, v in initial.items())
    result = {"starts_from_its_own_weights": same, "micro_batches": len(other.losses)}
    (out / f"other{rank}.json").write_text(json.dumps(result))


def test_a_fit_of_another_module_starts_from_that_modules_weights(tmp_path):
    in_ranks(fit_another_module, tmp_path)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"other{rank}.json").read_text()) == {"starts_from_its_own_weights": True,
                                                                            "micro_batches": 4}


def validate_from_a_checkpoint_then_fit(rank: int, out: Path) -> None:
    trainer, _ = fit(out, ZoffStrategy(), max_steps=2)
    trainer.save_checkpoint(out / "checkpoint")
    saved = trainer.strategy.full_state_dict()
    masters = KeepMasters()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZoffStrategy(), max_steps=1, callbacks=[masters],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = TinyModule()  # initialised afresh
    trainer.validate(module, token_loader(n=16, seed=1), ckpt_path=out / "checkpoint", verbose=False)
    trainer.fit(module, token_loader())
    same = all(torch.equal(masters.at_start[0][k], v) for k, v in saved.items())
    (out / f"validated{rank}.json").write_text(json.dumps(same))


def test_a_fit_after_validating_a_checkpoint_starts_from_its_weights(tmp_path):
    in_ranks(validate_from_a_checkpoint_then_fit, tmp_path)
    assert all(json.loads((tmp_path / f"validated{rank}.json").read_text()) for rank in (0, 1))
