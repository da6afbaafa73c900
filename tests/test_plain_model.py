"""A plain LightningModule (its embedding, norm and Linear head as top-level children, each a unit of its own) trains
under zoff as it does under DDP, and FSDP2 has nothing to warn about."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import helpers.trainer
import lightning_zoff.sharding
from helpers.tiny import VOCAB, token_loader
from lightning_zoff import ZoffStrategy
from lightning_zoff._compat import is_view

DIM = 16


class Plain(pl.LightningModule):
    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)  # with a bias: torch returns its 3-d output as a view
        self.in_place = in_place
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.head(self.norm(self.emb(x)))
        if self.in_place:
            logits.mul_(2.0)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class RecordWarnings(pl.Callback):
    """Records, in each rank, every warning and every log record of torch.distributed at WARNING or above from
    before the model is sharded to the end of the run; writes them to `out_dir/rank{r}.json`."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def setup(self, trainer, pl_module, stage):
        self.catcher = warnings.catch_warnings(record=True)
        self.caught = self.catcher.__enter__()
        warnings.simplefilter("always")
        self.logged: list[logging.LogRecord] = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = self.logged.append  # type: ignore[method-assign]
        logging.getLogger("torch.distributed").addHandler(self.handler)

    def teardown(self, trainer, pl_module, stage):
        self.catcher.__exit__(None, None, None)
        logging.getLogger("torch.distributed").removeHandler(self.handler)
        seen = {
            "warnings": [f"{w.filename}: {w.message}" for w in self.caught],
            "logs": [f"{r.name}: {r.getMessage()}" for r in self.logged],
            "losses": pl_module.losses,
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(seen))


def fit(out_dir: Path, strategy, in_place: bool = False) -> list[dict]:
    pl.seed_everything(3)
    helpers.trainer.fit(Plain(in_place), token_loader(n=64), strategy, max_steps=4, callbacks=[RecordWarnings(out_dir)])
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def from_fsdp(seen: dict) -> list[str]:
    fsdp = str(Path("torch", "distributed", "fsdp"))
    return [w for w in seen["warnings"] if fsdp in w or "FSDP" in w] + seen["logs"]


def test_a_plain_model_fits_without_a_warning_from_fsdp2(tmp_path):
    ranks = fit(tmp_path, ZoffStrategy(start_method="fork"))
    for seen in ranks:
        assert len(seen["losses"]) == 4  # the rank trained, and recorded while it did
        assert from_fsdp(seen) == []


@pytest.mark.skipif(torch.__version__ < "2.13", reason="FSDP2 warns about a view output from torch 2.13 on")
def test_fsdp2_warns_on_every_rank_when_a_unit_returns_a_view(tmp_path, monkeypatch):
    # what the test above would see if zoff handed FSDP2 the head's output as torch's Linear returns it
    monkeypatch.setattr(lightning_zoff.sharding, "_output_not_a_view", lambda module, args, output: None)
    for seen in fit(tmp_path, ZoffStrategy(start_method="fork")):
        assert any("(FSDPLinear) returned a view tensor" in w for w in from_fsdp(seen)), seen["warnings"]


def test_an_in_place_op_on_the_heads_output_trains_as_under_ddp(tmp_path):
    # on the view, it would move FSDP2's hook off the autograd graph: backward would read the freed head weights
    (tmp_path / "ddp").mkdir()
    (tmp_path / "zoff").mkdir()
    ddp = fit(tmp_path / "ddp", DDPStrategy(start_method="fork"), in_place=True)
    zoff = fit(tmp_path / "zoff", ZoffStrategy(start_method="fork"), in_place=True)
    for rank in (0, 1):
        assert len(zoff[rank]["losses"]) == 4
        torch.testing.assert_close(zoff[rank]["losses"], ddp[rank]["losses"], rtol=1e-5, atol=0)
    assert zoff[0]["losses"][-1] < zoff[0]["losses"][0]  # it learns, so the comparison means something


def test_only_a_view_that_needs_a_gradient_is_copied():
    x = torch.randn(2, 3, DIM, requires_grad=True)
    head, unbiased = nn.Linear(DIM, VOCAB), nn.Linear(DIM, VOCAB, bias=False)
    view = head(x)
    own = lightning_zoff.sharding._output_not_a_view(head, (x,), (view, 7))
    assert not is_view(own[0])
    assert own[1] == 7
    torch.testing.assert_close(own[0], view)
    own[0].sum().backward()
    torch.testing.assert_close(head.bias.grad, torch.full((VOCAB,), 6.0))  # the copy is on the autograd graph
    assert lightning_zoff.sharding._output_not_a_view(unbiased, (x,), unbiased(x)) is None  # not a view
    with torch.no_grad():
        assert lightning_zoff.sharding._output_not_a_view(head, (x,), head(x)) is None  # no backward to guard
