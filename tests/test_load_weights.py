"""Whole (unsharded) weights, such as a pretrained model's, loaded into the sharded model by every rank's rows."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing import ProcessRaisedException

import helpers.trainer
from helpers.resume_run import SaveBatch
from helpers.tiny import token_loader
from helpers.tiny_module import Probe, TinyModule, read_probe
from lightning_zoff import ZoffStrategy
from lightning_zoff.checkpoint.pretrained import OnDisk, to_module_names
from lightning_zoff.sharding import local_chunk


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
    helpers.trainer.fit(TinyModule(), token_loader(), ZoffStrategy(start_method="fork"), max_steps=1,
                        callbacks=[LoadAtStart(path, pretrained, tmp_path, strict), Probe(tmp_path),
                                   SaveBatch(0, tmp_path)])


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


def test_safetensors_rows_are_the_ranks_chunks(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {"rows": torch.randn(5, 3), "one": torch.randn(1, 4), "none": torch.zeros(0, 2), "vector": torch.randn(7),
               "scalar": torch.tensor(2.5)}
    save_file(tensors, tmp_path / "t.safetensors")
    file = safe_open(str(tmp_path / "t.safetensors"), framework="pt")
    for name, tensor in tensors.items():
        assert torch.equal(OnDisk(file, name).whole(), tensor)
        for world_size in (1, 2, 3, 4, 8):
            for rank in range(world_size):
                rows = OnDisk(file, name).local_chunk(world_size, rank)
                assert torch.equal(rows, local_chunk(tensor, world_size, rank))


def test_weights_get_the_modules_names():
    module = TinyModule()
    expected = module.state_dict().keys()
    inner = module.model.state_dict()  # as the inner model would save itself, without the attribute's name
    renamed, prefix = to_module_names(inner, expected, module)
    assert prefix == "model."
    assert renamed.keys() == expected
    renamed, prefix = to_module_names(module.state_dict(), expected, module)
    assert prefix == ""
    assert renamed.keys() == expected
    # one block's weights, explicitly into the second block
    block = module.model.blocks[0].state_dict()
    renamed, prefix = to_module_names(block, expected, module, prefix="model.blocks.1.")
    assert prefix == "model.blocks.1."
    assert renamed.keys() == module.model.blocks[1].state_dict(prefix=prefix).keys()
    blocks = r"\['model.blocks.0.', 'model.blocks.1.', 'model.blocks.2.'\]"
    with pytest.raises(ValueError, match=rf"equally under the prefixes {blocks}; pass prefix="):
        to_module_names(block, expected, module)
    with pytest.raises(ValueError, match=r"none of the 2 names .* TinyModule under prefix 'model.'.*\['a', 'b'\]"):
        to_module_names({"a": 0, "b": 1}, expected, module, prefix="model.")


def test_weights_of_which_no_name_matches_are_refused_even_when_not_strict(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"encoder.weight": torch.zeros(3), "encoder.bias": torch.zeros(3)}, path)
    with pytest.raises((ValueError, ProcessRaisedException), match=r"none of the 2 names .* TinyModule under any of its"
                       r" submodule prefixes: the weights hold \['encoder.bias', 'encoder.weight'\]"):
        train_from(tmp_path, path, {}, strict=False)
