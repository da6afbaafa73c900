"""A LightningModule that takes its network as an argument and keeps it in `save_hyperparameters()`: zoff's
checkpoints hold the network as DDP's do (the user's class, which `load_from_checkpoint` builds and fills), and what
cannot be pickled is refused in one line with nothing left behind. The reference is the same training under DDP."""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

import helpers.trainer
from helpers.tiny import INPUTS, TinyLM, adamw, loss_of, token_loader
from lightning_zoff import ZoffStrategy
from lightning_zoff.checkpoint.consolidate import consolidate
from lightning_zoff.checkpoint.pickling import UnpicklableCheckpoint

EPOCHS = 3


class TakesItsNetwork(pl.LightningModule):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = net

    def training_step(self, batch, batch_idx):
        return loss_of(self.net, *batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", loss_of(self.net, *batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", loss_of(self.net, *batch), sync_dist=True)

    def configure_optimizers(self):
        return adamw(self)


class HooksItsNetwork(TakesItsNetwork):
    """Its network, picklable when `save_hyperparameters` checks it, gets a hook pickle cannot store afterwards."""

    def setup(self, stage: str) -> None:
        self.net.register_forward_hook(lambda module, args, output: None)


class Tokens(pl.LightningDataModule):
    def train_dataloader(self):
        return token_loader(n=96)

    def val_dataloader(self):
        return token_loader(n=32, seed=1)

    test_dataloader = val_dataloader


class ValLosses(pl.Callback):
    """Rank 0 writes each epoch's validation loss to `out/val_losses.json`."""

    def __init__(self, out: Path) -> None:
        self.out, self.losses = out, []

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and trainer.is_global_zero:
            self.losses.append(trainer.callback_metrics["val_loss"].item())
            (self.out / "val_losses.json").write_text(json.dumps(self.losses))


def train(out: Path, strategy, module=None, **options) -> pl.Trainer:
    pl.seed_everything(7)
    best = ModelCheckpoint(dirpath=out / "ck", monitor="val_loss", filename="{epoch}")
    module = module or TakesItsNetwork(TinyLM())
    return helpers.trainer.fit(module, Tokens(), strategy, callbacks=[best, ValLosses(out)], max_epochs=EPOCHS,
                               enable_checkpointing=True, num_sanity_val_steps=0, **options)


def best_epoch(trainer: pl.Trainer) -> int:
    return int(re.search(r"epoch=(\d+)", trainer.checkpoint_callback.best_model_path)[1])


def val_losses(out: Path) -> list[float]:
    return json.loads((out / "val_losses.json").read_text())


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    return out, train(out, DDPStrategy(start_method="fork"))


@pytest.fixture(scope="module", params=["sharded", "full"])
def zoff(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    return out, train(out, ZoffStrategy(start_method="fork", state_dict_type=request.param))


def outputs_of(checkpoint: Path) -> tuple[torch.nn.Module, torch.Tensor]:
    module = TakesItsNetwork.load_from_checkpoint(checkpoint, weights_only=False)  # a file holding the user's classes
    with torch.no_grad():
        return module.net, module.net(INPUTS[:4])


@pytest.mark.slow  # the `ddp` and `zoff` fixtures train for several epochs
def test_losses_and_best_epoch_match_ddp(ddp, zoff):
    (ddp_out, ddp_trainer), (zoff_out, zoff_trainer) = ddp, zoff
    assert len(val_losses(zoff_out)) == EPOCHS
    torch.testing.assert_close(val_losses(zoff_out), val_losses(ddp_out), rtol=1e-5, atol=1e-5)
    assert best_epoch(zoff_trainer) == best_epoch(ddp_trainer)


@pytest.mark.slow
def test_best_checkpoint_loads_as_the_users_network_with_ddps_outputs(ddp, zoff, tmp_path):
    """A full export loads as it is; a sharded directory once consolidated into one file."""
    (_, ddp_trainer), (_, zoff_trainer) = ddp, zoff
    path = Path(zoff_trainer.checkpoint_callback.best_model_path)
    if path.is_dir():
        consolidate(path, tmp_path / "consolidated.ckpt", progress=False)
        path = tmp_path / "consolidated.ckpt"
    net, outputs = outputs_of(path)
    _, ddp_outputs = outputs_of(Path(ddp_trainer.checkpoint_callback.best_model_path))
    assert type(net) is TinyLM  # not FSDP's generated class
    assert type(net.blocks[0]).__name__ == "Block"
    torch.testing.assert_close(outputs, ddp_outputs, rtol=1e-5, atol=1e-5)


def resume(out: Path, strategy, trained: pl.Trainer) -> list[float]:
    """One epoch more from `trained`'s best checkpoint: the validation losses from there on."""
    out.mkdir()
    helpers.trainer.fit(TakesItsNetwork(TinyLM()), Tokens(), strategy, callbacks=[ValLosses(out)],
                        max_epochs=EPOCHS + 1, ckpt_path=trained.checkpoint_callback.best_model_path,
                        weights_only=False)  # the checkpoint holds the user's network classes
    return val_losses(out)


@pytest.mark.slow
def test_resumes_from_the_best_checkpoint_as_ddp_does(ddp, zoff, tmp_path):
    (_, ddp_trainer), (_, zoff_trainer) = ddp, zoff
    ours = resume(tmp_path / "zoff", ZoffStrategy(start_method="fork"), zoff_trainer)
    theirs = resume(tmp_path / "ddp", DDPStrategy(start_method="fork"), ddp_trainer)
    assert len(ours) == EPOCHS - best_epoch(zoff_trainer)  # from the epoch after the best one to the last
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tests_the_best_checkpoint_as_ddp_does(ddp, zoff):
    (_, ddp_trainer), (_, zoff_trainer) = ddp, zoff
    ours, theirs = (trainer.test(TakesItsNetwork(TinyLM()), Tokens(), ckpt_path="best", weights_only=False)
                    for trainer in (zoff_trainer, ddp_trainer))
    torch.testing.assert_close(ours[0]["test_loss"], theirs[0]["test_loss"], rtol=1e-5, atol=1e-5)


def test_unpicklable_hyperparameter_refused_in_one_line_leaving_nothing(tmp_path):
    with pytest.raises(UnpicklableCheckpoint) as refusal:
        train(tmp_path, ZoffStrategy(start_method="fork"), module=HooksItsNetwork(TinyLM()),
              limit_train_batches=1, limit_val_batches=1)
    message = str(refusal.value)
    assert "\n" not in message
    assert "checkpoint['hyper_parameters']['net'] cannot be pickled" in message
    assert "self.save_hyperparameters(ignore=['net'])" in message
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())  # no checkpoint, no partial one
