"""The unit policy (`lightning_zoff/units.py`) on the module trees people write, without a Trainer: which modules
become FSDP2 units, in which order, and what is refused."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from helpers.nanogpt import NanoGPT
from lightning_zoff.examples.gpt import GPTModule
from lightning_zoff.units import ROOT, forward_order, plan_units


def names(units):
    return [unit.name for unit in units]


def test_nanogpt_layout_descends_into_the_module_dict_and_groups_the_tied_embedding_with_the_head():
    model = NanoGPT(tie=True)
    units = plan_units(model)
    assert names(units) == ["transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.wte+lm_head",
                            "transformer.wpe", "transformer.ln_f"]
    tied = units[3]
    assert tied.modules == (model.transformer.wte, model.lm_head)
    assert tied.holds("transformer.wte.weight")
    assert tied.holds("lm_head.weight")
    assert not tied.holds("transformer.wpe.weight")
    assert [unit.is_block for unit in units] == [True] * 3 + [False] * 3
    # a forward enters the group with the embedding, first of all; the head's place is the group's
    assert forward_order(model, units) == ["transformer.wte+lm_head", "transformer.wpe", "transformer.h.0",
                                           "transformer.h.1", "transformer.h.2", "transformer.ln_f"]


def test_untied_embedding_and_head_stay_units_of_their_own():
    units = plan_units(NanoGPT(tie=False))
    assert names(units) == ["transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.wte",
                            "transformer.wpe", "transformer.ln_f", "lm_head"]
    assert all(len(unit.modules) == 1 for unit in units)


class Mixed(LightningModule):
    """A ModuleList of different modules (no repeated blocks) and a ModuleDict, both without a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)])
        self.heads = nn.ModuleDict(dict(a=nn.Linear(4, 2), b=nn.Sequential(nn.Linear(4, 4), nn.Tanh())))


def test_containers_without_forward_are_walked_into_and_never_units():
    units = plan_units(Mixed())
    assert names(units) == ["stages.0", "stages.2", "heads.a", "heads.b"]  # ReLU holds no parameter


class OwnParameter(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))


class ParameterContainer(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.extra = nn.ParameterDict({"scale": nn.Parameter(torch.ones(4))})


def test_parameters_only_the_root_forward_can_gather_are_refused_under_the_trainer_and_a_unit_under_fabric():
    with pytest.raises(ValueError, match=r"OwnParameter holds parameters directly, .* the LightningModule is not"
                                         r" called as a module in training\. Move these parameters into a submodule"):
        plan_units(OwnParameter())
    with pytest.raises(ValueError, match=r"ParameterContainer\.extra holds parameters directly, .* ParameterDict has"
                                         r" no forward and is not called as a module"):
        plan_units(ParameterContainer())
    # Fabric calls the model: its root gathers what it holds, last in sharding order, first in forward order
    model = OwnParameter()
    units = plan_units(model, root_runs_forward=True)
    assert names(units) == ["body", ROOT]
    assert units[1].module is model
    assert units[1].holds("scale")
    assert units[1].holds("body.weight")
    assert forward_order(model, units) == [ROOT, "body"]
    assert names(plan_units(ParameterContainer(), root_runs_forward=True)) == ["body", ROOT]


class SharedBlocks(LightningModule):
    """ALBERT-style: every block shares its weight with the first; the shared blocks are not units of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        for block in self.blocks[1:]:
            block.weight = self.blocks[0].weight
        self.head = nn.Linear(4, 8)


def test_blocks_that_share_weights_go_to_one_unit_with_their_list():
    units = plan_units(SharedBlocks())
    assert names(units) == ["embed", "blocks.0+blocks.1+blocks.2", "head"]


def test_wrap_policy_names_the_blocks():
    model = NanoGPT(tie=False)
    units = plan_units(model, {nn.LayerNorm})
    assert [u.name for u in units if u.is_block] == [
        "transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.h.1.ln_1", "transformer.h.1.ln_2",
        "transformer.h.2.ln_1", "transformer.h.2.ln_2", "transformer.ln_f"]
    # what the blocks leave: each block (it has a forward) is a unit of the rest
    assert [u.name for u in units if not u.is_block] == [
        "transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.h.2", "lm_head"]


class HoldsLitGPT(LightningModule):
    """LitGPT's GPT held by a LightningModule, as LitGPT's Lightning examples write it."""

    def __init__(self) -> None:
        super().__init__()
        from litgpt.config import Config
        from litgpt.model import GPT

        self.model = GPT(Config(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, padded_vocab_size=64))


def test_the_models_of_known_libraries_held_by_a_lightning_module_are_walked_into():
    # a model with a forward is one unit of what the blocks leave, unless its library calls its children as modules
    # (transformers': test_hf.py): then the embedding, final norm and head are units of their own
    gpt = GPTModule(block_size=16, n_layer=2, n_head=2, n_embd=32)
    assert names(plan_units(gpt)) == ["model.blocks.0", "model.blocks.1", "model.tok_emb", "model.pos_emb",
                                      "model.ln_f", "model.lm_head"]
    pytest.importorskip("litgpt")
    assert names(plan_units(HoldsLitGPT())) == ["model.transformer.h.0", "model.transformer.h.1", "model.lm_head",
                                                "model.transformer.wte", "model.transformer.ln_f"]


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h @ self.embed.weight.T  # the embedding's weight read outside its own forward


class HoldsWrapper(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Wrapper()


def test_a_model_of_unknown_code_stays_one_unit_of_what_the_blocks_leave():
    assert names(plan_units(HoldsWrapper())) == ["net.blocks.0", "net.blocks.1", "net"]
