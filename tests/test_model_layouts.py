"""Models as people write them, trained under zoff on 2 CPU ranks against DDP: nanoGPT's layout (a ModuleDict of
embeddings, blocks and norm beside the head), with the embedding tied to the head across top-level children and
without; the tie through training, a full checkpoint loaded into the plain model, and a sharded one resumed."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

import helpers.trainer
from helpers.compare import rel_err
from helpers.nanogpt import NanoGPT
from helpers.tiny import token_loader
from helpers.tiny_module import read_probe
from lightning_zoff import ZoffStrategy

TIED = ("transformer.wte.weight", "lm_head.weight")


def fit(out, strategy, *, tie: bool, max_steps: int = 8, ckpt_path=None, callbacks=(), samples: int = 192):
    """The trained module (its weights: rank 0's) and rank 0's micro-batch losses."""
    pl.seed_everything(3)
    module = NanoGPT(tie=tie)
    helpers.trainer.fit(module, token_loader(n=samples), strategy, out=out, max_steps=max_steps, accumulate=2, clip=0.5,
                        callbacks=callbacks, ckpt_path=ckpt_path, enable_checkpointing=True)
    return module, read_probe(out)["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_nanogpt_layout_trains_as_under_ddp(tmp_path, tie):
    ddp, ddp_losses = fit(tmp_path / "ddp", DDPStrategy(start_method="fork"), tie=tie)
    zoff, losses = fit(tmp_path / "zoff", ZoffStrategy(start_method="fork", weights_to_main_process=True), tie=tie)
    assert len(losses) == len(ddp_losses) == 16  # rank 0's micro-batches: 8 steps of 2
    assert rel_err(losses, ddp_losses) < 1e-5
    assert losses[-1] < losses[0] - 0.3  # it learns, so the comparison means something
    trained, reference = zoff.state_dict(), ddp.state_dict()
    assert trained.keys() == reference.keys()
    for name, value in trained.items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-5, msg=name)
    if tie:
        assert zoff.lm_head.weight is zoff.transformer.wte.weight


class SaveFull(pl.Callback):
    """Rank by rank, a full (one-file) checkpoint at the end of training: every rank gathers, rank 0 writes."""

    def __init__(self, path):
        self.path = path

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


def test_the_tie_holds_in_a_full_checkpoint_loaded_into_the_plain_model(tmp_path):
    path = tmp_path / "full.ckpt"
    fit(tmp_path / "zoff", ZoffStrategy(start_method="fork", state_dict_type="full"), tie=True, max_steps=6,
        callbacks=[SaveFull(path)])
    state = torch.load(path, weights_only=True)["state_dict"]
    # both names of the tied weight, one value: had the ranks' shards of the two come apart, these would differ
    assert torch.equal(state[TIED[0]], state[TIED[1]])
    ddp, _ = fit(tmp_path / "ddp", DDPStrategy(start_method="fork"), tie=True, max_steps=6)
    torch.testing.assert_close(state[TIED[0]], ddp.lm_head.weight, rtol=1e-5, atol=1e-5)
    plain = NanoGPT(tie=True)
    plain.load_state_dict(state)
    assert plain.lm_head.weight is plain.transformer.wte.weight
    torch.testing.assert_close(plain.lm_head.weight, ddp.lm_head.weight, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_sharded_checkpoint_of_the_tied_model_resumes_bit_for_bit(tmp_path):
    # 48 samples: 6 micro-batches per rank and epoch, 3 steps; the checkpoint at the end of the first epoch
    every3 = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_train_steps=3)
    whole, losses = fit(tmp_path / "whole", ZoffStrategy(start_method="fork", weights_to_main_process=True), tie=True,
                        max_steps=6, samples=48, callbacks=[every3])
    path = tmp_path / "ck" / "epoch=0-step=3.ckpt"
    resumed, resumed_losses = fit(tmp_path / "resumed", ZoffStrategy(start_method="fork", weights_to_main_process=True),
                                  tie=True, max_steps=6, samples=48, ckpt_path=path)
    assert len(losses) == 12
    assert resumed_losses == losses[6:]  # the second epoch's micro-batches on rank 0
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, whole.state_dict()[name]), name
