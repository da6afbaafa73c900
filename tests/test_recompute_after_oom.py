"""activation_checkpointing_policy="auto" and a step that does not fit the accelerator: the blocks get torch's
activation checkpointing at setup, switched off unless the plan chose it; a step that runs out of memory with no state
to move back switches it on and runs again, with the bits of a run that recomputed from the start."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

import helpers.trainer
from helpers import tiny
from helpers.reference import SEED, train_on_one_process
from helpers.tiny import GLOBAL, token_loader
from helpers.tiny_module import TinyModule, read_probe
from lightning_zoff import ZoffStrategy
from lightning_zoff._compat import checkpoint_activations_of, recomputes_activations, set_recompute

STEPS, MAX_NORM = 4, 0.84


class Block(tiny.Block):
    """A block whose activations do not fit while `tight` (a training forward that keeps them, as Llama-3-8B's logits
    at batch 4 do on one GPU): its forward raises what CUDA's allocator raises."""

    def __init__(self) -> None:
        super().__init__()
        self.tight, self.calls = False, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # a recomputation in backward runs forward again
        if self.tight:
            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 7.83 GiB")
        return super().forward(x)


class TightFirstStep(TinyModule):
    """The tiny model with `Block`s (its initial weights kept): the middle block's forward runs out of memory in the
    first step when `tight` says so: "kept" (while its activations are kept), "always" or "never"."""

    def __init__(self, out: Path, tight: str) -> None:
        super().__init__(step_lr=False)  # the reference steps no scheduler
        for i, plain in enumerate(self.model.blocks):
            block = Block()
            block.load_state_dict(plain.state_dict())
            self.model.blocks[i] = block
        self.out, self.tight = out, tight

    def training_step(self, batch, batch_idx):
        middle = self.model.blocks[1]
        kept = not recomputes_activations(middle)
        middle.tight = self.trainer.global_step == 0 and (self.tight == "always" or (self.tight == "kept" and kept))
        return super().training_step(batch, batch_idx)

    def on_train_end(self):
        calls = sum(b.calls for b in self.model.blocks)
        (self.out / "calls.json").write_text(json.dumps(calls))


class Said(pl.Callback):
    """What zoff logged in the rank (the rank is a forked process: the test's own handlers do not see it)."""

    def __init__(self, out: Path) -> None:
        self.out, self.lines = out, []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.lines.append(record.getMessage())  # type: ignore[method-assign]

    def setup(self, trainer, pl_module, stage):
        logging.getLogger("lightning_zoff").addHandler(self.handler)

    def on_train_end(self, trainer, pl_module):
        (self.out / "said.json").write_text(json.dumps(self.lines))


def train(out: Path, policy, tight: str) -> dict:
    out.mkdir()
    pl.seed_everything(SEED)
    module = TightFirstStep(out, tight)
    strategy = ZoffStrategy(start_method="fork", weights_to_main_process=True, activation_checkpointing_policy=policy)
    data = token_loader(n=240, batch_size=GLOBAL)  # step i takes `micro_batch(i, 0, 1)`, as the reference does
    helpers.trainer.fit(module, data, strategy, out=out, devices=1, max_steps=STEPS, clip=MAX_NORM,
                        callbacks=[Said(out)], use_distributed_sampler=False)  # the loader's order
    return {"losses": read_probe(out)["losses"], "weights": module.state_dict(),
            "calls": json.loads((out / "calls.json").read_text()), "said": json.loads((out / "said.json").read_text())}


def test_a_step_out_of_memory_recomputes_the_blocks_from_then_on(tmp_path):
    auto = train(tmp_path / "auto", "auto", tight="kept")
    named = train(tmp_path / "named", {Block}, tight="kept")
    assert auto["losses"] == named["losses"]  # the failed try logged no loss: it failed before the loss existed
    for name, value in named["weights"].items():
        assert torch.equal(auto["weights"][name], value), name
    # the failed try ran block 0 and entered block 1; every step after recomputes 3 blocks: 2 forwards each
    assert (auto["calls"], named["calls"]) == (2 + STEPS * 3 * 2, STEPS * 3 * 2)
    said = [line for line in auto["said"] if "ran out" in line]
    assert said == [("zoff rank 0: the step ran out of accelerator memory; recomputing Block activations from now on"
                     " ('auto'), the batch runs again")]
    # and both train as torch's AdamW on one process with the whole model (a sum's order differs: not bit for bit)
    losses, weights = train_on_one_process(STEPS, accumulate=1, max_norm=MAX_NORM, world_size=1)
    assert auto["losses"] == pytest.approx([loss for (loss,) in losses], rel=1e-5)
    for name, value in weights.items():
        torch.testing.assert_close(auto["weights"][f"model.{name}"], value, rtol=1e-4, atol=1e-5)


def test_auto_installs_recompute_switched_off_at_no_cost(tmp_path):
    # the step never runs out of memory here: "auto" keeps recompute off, and its hooks change no bit
    auto = train(tmp_path / "auto", "auto", tight="never")
    none = train(tmp_path / "none", None, tight="never")
    assert auto["losses"] == none["losses"]
    for name, value in none["weights"].items():
        assert torch.equal(auto["weights"][name], value), name
    assert auto["calls"] == none["calls"] == STEPS * 3  # one forward per block and step: nothing recomputed
    assert not [line for line in auto["said"] if "ran out" in line]


def test_a_step_out_of_memory_with_recompute_on_raises(tmp_path):
    # switching recompute on is the last thing "auto" can change: the rerun fails too, and its error reaches the caller
    with pytest.raises((torch.OutOfMemoryError, ProcessRaisedException), match="injected: CUDA out of memory"):
        train(tmp_path / "always", "auto", tight="always")


def test_switched_off_checkpointing_computes_as_none_and_switches_on():
    torch.manual_seed(0)
    switched, plain = Block(), Block()
    plain.load_state_dict(switched.state_dict())
    assert checkpoint_activations_of(switched, recompute=False)
    assert not recomputes_activations(switched)
    assert not recomputes_activations(plain)  # none installed
    x = torch.randn(2, tiny.SEQ, tiny.DIM)
    for on in (False, True):
        set_recompute(switched, on)
        assert recomputes_activations(switched) is on
        switched.calls = plain.calls = 0
        switched.zero_grad()
        plain.zero_grad()
        switched(x).square().sum().backward()
        plain(x).square().sum().backward()
        assert (switched.calls, plain.calls) == (2 if on else 1, 1)  # on: the forward runs again in backward
        for a, b in zip(switched.parameters(), plain.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
