"""Whole (unsharded) weights, such as a pretrained model's, loaded into the sharded model by every rank's rows."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing import ProcessRaisedException

from lightning_zoff import ZoffStrategy
from resume_run import SaveBatch
from tiny import Probe, TinyModule, read_probe, token_loader


class LoadAtStart(pl.Callback):
    def __init__(self, path: Path, pretrained: dict, out: Path, strict: bool = True):
        self.path, self.pretrained, self.out, self.strict = path, pretrained, out, strict

    def on_fit_start(self, trainer, pl_module):
        trainer.strategy.load_full_state_dict(self.path, strict=self.strict)
        gathered = trainer.strategy.full_state_dict()  # the fp32 masters, from every rank's rows
        same = all(torch.equal(gathered[k], v) for k, v in self.pretrained.items())
        (self.out / f"same{trainer.global_rank}.json").write_text(json.dumps(same))


def train_from(tmp_path, path, pretrained, strict=True):
    pl.seed_everything(7)  # another init than the pretrained weights'
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ZoffStrategy(start_method="fork"), max_steps=1, logger=False,
        callbacks=[LoadAtStart(path, pretrained, tmp_path, strict), Probe(tmp_path), SaveBatch(0, tmp_path)],
        enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(TinyModule(), token_loader())


def test_loaded_weights_give_the_full_models_loss(tmp_path):
    pl.seed_everything(123)
    pretrained = TinyModule()
    path = tmp_path / "pretrained.pt"
    torch.save(pretrained.state_dict(), path)
    train_from(tmp_path, path, pretrained.state_dict())
    assert all(json.loads((tmp_path / f"same{r}.json").read_text()) for r in (0, 1))  # bit for bit, both ranks
    # rank 0's first batch through the plain full model
    x, y = torch.load(tmp_path / "batch0.pt")
    with torch.no_grad():
        expected = F.cross_entropy(pretrained.model(x).flatten(0, 1), y.flatten()).item()
    assert read_probe(tmp_path)["losses"][0] == pytest.approx(expected, rel=1e-6)


def test_mismatched_keys_are_named(tmp_path):
    pl.seed_everything(123)
    state = TinyModule().state_dict()
    state["model.extra.weight"] = state.pop("model.head.weight")
    path = tmp_path / "other.pt"
    torch.save(state, path)
    with pytest.raises((KeyError, ProcessRaisedException), match=r"missing keys \['model.head.weight'\].*unexpected"):
        train_from(tmp_path, path, {})
