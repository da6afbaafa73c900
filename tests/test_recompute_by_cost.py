"""How many blocks "auto" recomputes when their recompute costs more than the host's update of the optimizer state
their activations displace (`placement/step_costs.py`, issue 53): the operations the trace counts against a hand count,
the trade per block by hand, the fewest blocks with which the plan fits, and the Trainer's setup on a CPU standing in
for a GPU of a given size with the rates given: recompute dear, it keeps the activations and the host takes the state;
recompute cheap, it recomputes as before."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from torch import nn

from helpers import tiny
from helpers.simulated_accelerator import LoggingModule, four_blocks, step_total, with_accelerator
from helpers.tiny import TinyLM, token_loader
from helpers.trainer import fit
from lightning_zoff import ZoffStrategy
from lightning_zoff._compat import recomputes_activations
from lightning_zoff.placement import Machine, PlanDoesNotFit, StateOptions, UnitShape, plan_memory, rank as rank_memory
from lightning_zoff.placement.machine import GiB
from lightning_zoff.placement.plan import StepMemory
from lightning_zoff.placement.recompute_choice import fewest_by_halves, fewest_that_fit
from lightning_zoff.placement.step_costs import BlockTrade, Rates, block_trade
from lightning_zoff.placement.step_trace import StepProbe, trace_step_work
from lightning_zoff.sharding import checkpoint_activations

CPU = torch.device("cpu")


def test_the_trace_counts_the_operations_by_hand():
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.ReLU(), nn.Linear(512, 10, bias=False))
    probe = StepProbe(lambda: torch.zeros(64, 256), lambda x: model(x).pow(2).mean(), contextlib.nullcontext)
    flops = trace_step_work(model, probe, torch.zeros(64, 256), CPU, torch.float32).flops
    forward = 2 * 64 * 256 * 512 + 2 * 64 * 512 * 10
    # backward: the second layer's weight and input gradients, the first layer's weight gradient (the batch needs none)
    backward = 2 * 64 * 512 * 10 + 2 * 64 * 10 * 512 + 2 * 64 * 256 * 512
    assert flops == forward + backward


def test_recompute_adds_the_blocks_forwards():
    model = TinyLM()
    batch = (torch.zeros(4, tiny.SEQ, dtype=torch.long), torch.zeros(4, tiny.SEQ, dtype=torch.long))
    probe = StepProbe(lambda: batch, lambda b: tiny.loss_of(model, *b), contextlib.nullcontext)
    kept = trace_step_work(model, probe, batch, CPU, torch.float32)
    checkpoint_activations(model, {tiny.Block})
    recomputed = trace_step_work(model, probe, batch, CPU, torch.float32)
    # each block's forward runs once more, up to the last tensor its backward needs (torch stops the recompute there):
    # the qkv, proj and fc1 products (3D, D and 4D wide), not fc2, whose output nothing saved; the CPU's attention
    # kernel has no formula in torch's counter (the GPU's have)
    tokens, d = 4 * tiny.SEQ, tiny.DIM
    assert recomputed.flops - kept.flops == len(model.blocks) * 2 * tokens * d * (3 * d + d + 4 * d)
    assert recomputed.activations < kept.activations


def test_a_block_trade_by_hand():
    kept = StepMemory(activations=10 * GiB, gathered=0, batch="a batch", flops=100 * 10**12)
    recomputed = StepMemory(activations=2 * GiB, gathered=0, batch="a batch", flops=130 * 10**12)
    rates = Rates(accelerator_flops_per_s=1e14, host_s_per_element=1e-9)
    # a block: 7.5 TFLOP of forward at 100 TFLOP/s, 18 times; 2 GiB of activations, at 16 bytes an element of state
    trade = block_trade(kept, recomputed, blocks=4, micro_batches=18, accelerator_bytes_per_element=16, rates=rates)
    assert trade.recompute_s == pytest.approx(7.5e12 * 18 / 1e14)
    assert trade.displaced_s == pytest.approx(2 * GiB / 16 * 1e-9)
    assert trade.keep_activations
    assert not block_trade(kept, recomputed, 4, 1, 16, rates).keep_activations  # one micro-batch: 75 ms < 134 ms
    assert trade.describe(18) == ("a block recomputed costs 1350.0 ms a step (18 micro-batches), the optimizer state"
                                  " its activations displace 134.2 ms of host update")
    assert not BlockTrade(recompute_s=0.0, displaced_s=0.0).keep_activations  # no cost counted: recompute, as before


@pytest.mark.parametrize("first", [1, 2, 3, 4, 5, 6, 7])
def test_the_fewest_by_halves(first):
    asked = []

    def fits(n):
        asked.append(n)
        return n >= first

    assert fewest_by_halves(0, 7, fits) == first
    assert len(asked) <= 3  # log2 of the seven candidates


def test_the_fewest_blocks_with_which_the_plan_fits():
    blocks, trace, steps = four_blocks()
    options = StateOptions(param_bytes=2, moment_bytes=4, moments=2, sum_bytes=0)

    def plan_with(step):  # the GPU holds its slack (1 GiB) and a step between two recomputed blocks' and three's
        return plan_memory([UnitShape("model", 0, 0, True)], options,
                           Machine(10**13, GiB + (steps[2].total + steps[3].total) // 2), "none", model_bytes=0,
                           step=step)

    chosen = fewest_that_fit(blocks, 4, None, trace, plan_with)
    assert chosen is not None
    assert chosen[0] == 3
    assert chosen[1].total == steps[3].total
    assert [recomputes_activations(b) for b in blocks] == [True, True, True, False]
    # the step with none fits: none recomputed
    assert fewest_that_fit(blocks, 4, steps[0], trace, plan_with) == (0, steps[0])
    assert not any(recomputes_activations(b) for b in blocks)
    # no fewer than `most` fit: None, and the first `most` recompute
    assert fewest_that_fit(blocks, 3, None, trace, plan_with) is None
    assert [recomputes_activations(b) for b in blocks] == [True, True, True, False]
    with pytest.raises(PlanDoesNotFit):
        plan_with(steps[2])


# -- the Trainer's setup -----------------------------------------------------------------------------------------

DEAR_RECOMPUTE = Rates(accelerator_flops_per_s=1.0, host_s_per_element=1e-12)
CHEAP_RECOMPUTE = Rates(accelerator_flops_per_s=1e18, host_s_per_element=1.0)


def auto_run(tmp_path, monkeypatch, rates: Rates, accumulate: int, devices: int = 1) -> None:
    """The tiny LM on an accelerator with room for the model, the step that keeps its activations and a little of the
    state, not all of it: "auto" (recompute and state) at `accumulate` micro-batches a step, `rates` measured."""
    kept = step_total(LoggingModule(), False, world_size=devices)
    module = LoggingModule()
    model_bytes = sum(p.numel() for p in module.parameters()) * 4
    # the slack, the rank's model shard, the step with FSDP2's buffers, and a third of the rank's state (12 B/param)
    with_accelerator(monkeypatch, GiB + model_bytes // devices + kept + model_bytes // devices)
    monkeypatch.setattr(rank_memory, "measure_rates", lambda device, moment_dtype, host_rate: rates)
    monkeypatch.chdir(tmp_path)
    strategy = ZoffStrategy(start_method="fork", accelerator_state="auto", accelerator_update_share="none")
    fit(module, token_loader(tiny.GLOBAL), strategy, devices=devices, max_steps=1, accumulate=accumulate)


@pytest.mark.parametrize("devices", [1, 2])
def test_auto_keeps_the_activations_where_their_recompute_costs_more(tmp_path, monkeypatch, said, devices):
    auto_run(tmp_path, monkeypatch, DEAR_RECOMPUTE, accumulate=4, devices=devices)
    chosen = [line for line in said.lines if line.startswith("recomputing")]
    assert len(chosen) == 1, said.lines  # two ranks agree (the rates reduced over them): one line for the node
    assert re.match(r"recomputing none of the 3 Block blocks' activations \('auto', by cost: a block recomputed costs"
                    r" [\d.]+ ms a step \(4 micro-batches\), the optimizer state its activations displace [\d.]+ ms of"
                    r" host update\): the step at a batch of 4 x \d+ needs .*, the host holds the state the GPU cannot",
                    chosen[0]), chosen[0]
    assert any(re.match(r"state: \d+ unit\(s\) on the accelerator .* [1-9]\d* on the host", line)
               for line in said.lines), said.lines


def test_auto_recomputes_where_the_host_update_costs_more(tmp_path, monkeypatch, said):
    auto_run(tmp_path, monkeypatch, CHEAP_RECOMPUTE, accumulate=4)
    chosen = [line for line in said.lines if line.startswith("recomputing")]
    assert len(chosen) == 1, said.lines
    assert "by cost" not in chosen[0]  # the rule before costs: as much recompute as lets the state onto the GPU
