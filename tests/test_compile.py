"""Blocks compiled with `torch.compile` in `configure_model` (`block.compile()`, as Lightning users write it) train
under zoff as under DDP with the same compiled blocks."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch._dynamo.utils import counters

from helpers.compare import rel_err
from helpers.tiny_module import TinyModule, read_probe
from lightning_zoff import ZoffStrategy
from test_training import fit

pytestmark = pytest.mark.slow  # torch.compile's first compilation of the blocks takes seconds


class CompiledBlocks(TinyModule):
    def __init__(self) -> None:
        torch.manual_seed(0)  # the same initial weights in both runs
        super().__init__()

    def configure_model(self) -> None:
        for block in self.model.blocks:
            block.compile()


class CompiledGraphs(pl.Callback):
    """Writes how many graphs dynamo compiled in rank 0: the blocks ran compiled, not eagerly."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            (self.out / "graphs.json").write_text(json.dumps(counters["stats"]["unique_graphs"]))


def test_compiled_blocks_train_as_under_ddp(tmp_path):
    ref = tmp_path / "ddp"
    ref.mkdir()
    fit(ref, DDPStrategy(start_method="fork"), module=CompiledBlocks(), max_steps=4)
    fit(tmp_path, ZoffStrategy(start_method="fork"), module=CompiledBlocks(), max_steps=4,
        callbacks=[CompiledGraphs(tmp_path)])
    assert json.loads((tmp_path / "graphs.json").read_text()) > 0
    zoff, ddp = read_probe(tmp_path), read_probe(ref)
    assert len(zoff["losses"]) == 8  # 4 steps x 2 micro-batches
    assert rel_err(zoff["losses"], ddp["losses"]) < 1e-5
    assert zoff["losses"][-1] < zoff["losses"][0]
