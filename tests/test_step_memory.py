"""The step's own accelerator memory, traced at setup on fake tensors (`placement/step_trace.py`): the trace against
bytes counted by hand for a small model at a known shape, the plan that counts it (a step that does not fit refused
in one line with the batch that would fit), and the Trainer's setup: the batch read from the DataLoader, "auto"
switching recompute on where only so the step fits, the refusal before anything is allocated, and a step that cannot
be traced falling back to the first step's peak."""

from __future__ import annotations

import contextlib
import re

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from helpers import tiny
from helpers.simulated_accelerator import LoggingModule, four_blocks, step_bytes, step_total, with_accelerator
from helpers.tiny import TinyLM, token_loader
from helpers.trainer import fit
from lightning_zoff import ZoffStrategy
from lightning_zoff._compat import fake_tensor_mode, recomputes_activations, set_recompute
from lightning_zoff.placement import Machine, PlanDoesNotFit, StateOptions, UnitShape, plan_memory
from lightning_zoff.placement.machine import GiB
from lightning_zoff.placement.plan import REDUCED_IN_FLIGHT, StepMemory
from lightning_zoff.placement.rank import gathered_bytes, unit_shapes_before_sharding
from lightning_zoff.placement.recompute_choice import fewer_for_all_state, fewest_blocks, linear_guess
from lightning_zoff.placement.step_trace import LiveBytes, StepProbe, fake_parameters, trace_step
from lightning_zoff.sharding import checkpoint_activations
from lightning_zoff.units import forward_order, plan_units

CPU = torch.device("cpu")
BATCH = 4  # token_loader's
F32 = 4


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(256, 512, bias=False), nn.ReLU(), nn.Linear(512, 10, bias=False))


def probe_of(model: nn.Module) -> StepProbe:
    return StepProbe(lambda: torch.zeros(64, 256), lambda x: model(x).pow(2).mean(), contextlib.nullcontext)


def test_the_trace_counts_a_step_by_hand():
    model = mlp()
    peak = trace_step(model, probe_of(model), torch.zeros(64, 256), CPU, torch.float32)
    # the peak is at the first layer's weight gradient: the matmul makes it in the transposed layout (512 x 256) and
    # autograd copies it into the weight's own; beside them only the loss and its gradient (4 bytes each). The
    # activations (64 x 512) and the gradient at the first layer's output are gone by then (the matmul has read it; the
    # batch needs no gradient); the parameters never count
    assert peak == 2 * 512 * 256 * F32 + 2 * F32


def test_the_forward_keeps_what_backward_needs_and_the_parameters_come_back():
    model = mlp()
    weights = list(model.parameters())
    with torch.random.fork_rng(), contextlib.ExitStack() as stack:
        stack.enter_context(fake_tensor_mode())
        stack.enter_context(fake_parameters(model, CPU, torch.float32))
        x = torch.empty(64, 256)
        with LiveBytes() as live:
            loss = model(x).pow(2).mean()
            # kept: the ReLU's output (64 x 512: its own backward and the second layer's), the output (64 x 10: the
            # square's backward), the loss; the first layer's output went once the ReLU had read it
            assert live.now == 64 * 512 * F32 + 64 * 10 * F32 + F32
            assert live.peak == 2 * 64 * 512 * F32  # the first layer's output and the ReLU's, at once
            del loss
    assert list(model.parameters()) == weights  # the real ones, not the fakes
    assert all(p.grad is None and p.device == CPU for p in weights)


def test_recompute_and_a_16_bit_model_hold_less():
    model = TinyLM()
    batch = (torch.zeros(4, tiny.SEQ, dtype=torch.long), torch.zeros(4, tiny.SEQ, dtype=torch.long))
    probe = StepProbe(lambda: batch, lambda b: tiny.loss_of(model, *b), contextlib.nullcontext)
    kept = trace_step(model, probe, batch, CPU, torch.float32)
    half = trace_step(model, probe, batch, CPU, torch.bfloat16)
    checkpoint_activations(model, {tiny.Block})
    recomputed = trace_step(model, probe, batch, CPU, torch.float32)
    assert recomputed < 0.6 * kept
    assert half < 0.6 * kept


def shapes() -> list[UnitShape]:
    return [UnitShape(f"h.{i}", 10**8, 10**8, True) for i in range(4)]


OPTIONS = StateOptions(param_bytes=2, moment_bytes=4, moments=2, sum_bytes=0)


def test_the_plan_counts_the_step_and_names_the_batch_that_fits():
    machine = Machine(10**13, 18 * GiB)  # 1 GiB of slack: 17 GiB for the model, the state and the step
    step = StepMemory(activations=16 * GiB, gathered=GiB // 2, batch="a batch of 8 x 4096", samples=8)
    with pytest.raises(PlanDoesNotFit) as refused:
        plan_memory(shapes(), OPTIONS, machine, "none", model_bytes=GiB, step=step)
    text = str(refused.value)
    assert re.search(r"needed at the step's peak: model 1\.1 GB, optimizer state 0\.0 MB, the step at a batch of 8 x"
                     r" 4096 17\.7 GB \(activations 17\.2 GB, FSDP2's buffers 0\.5 GB\)", text), text
    # 2 GiB a sample: 7 samples (14 GiB) and FSDP2's 0.5 fit beside the model's 1 and the slack's 1 in 18; 8 do not
    assert "a batch of 7 (about 15.6 GB for the step): fits" in text
    fits = plan_memory(shapes(), OPTIONS, machine, "none", model_bytes=GiB, step=step.at_samples(7))
    assert fits.report()["accelerator_step"] == 7 * 2 * GiB + GiB // 2


# -- the Trainer's setup ----------------------------------------------------------------------------------------


def run(tmp_path, monkeypatch, capacity: int, module: pl.LightningModule | None = None) -> pl.Trainer:
    with_accelerator(monkeypatch, capacity)
    strategy = ZoffStrategy(start_method="fork", accelerator_state="none", accelerator_update_share="none")
    monkeypatch.chdir(tmp_path)  # the rank inherits the patches: it is forked
    return fit(module or LoggingModule(), token_loader(tiny.GLOBAL), strategy, devices=1, max_steps=1)


def test_setup_counts_the_step_at_the_loaders_batch(tmp_path, monkeypatch, said):
    run(tmp_path, monkeypatch, 4 * GiB)
    counted = [line for line in said.lines if line.startswith("the plan counts the step at a batch of")]
    assert len(counted) == 1, said.lines
    assert counted[0].startswith(f"the plan counts the step at a batch of {BATCH} x {tiny.SEQ} ")
    assert not any("recomputing" in line for line in said.lines)


def test_auto_recomputes_where_only_so_the_step_fits(tmp_path, monkeypatch, said):
    kept, recomputed = step_total(LoggingModule(), False), step_total(LoggingModule(), True)
    module = LoggingModule()
    model_bytes = sum(p.numel() for p in module.parameters()) * F32
    units = plan_units(module)
    shapes, _ = unit_shapes_before_sharding(module, units, 1, F32)
    # all the state on the accelerator: fp32 master and two moments, and an update's workspace (its fp32 gradient)
    state = 3 * model_bytes + max(s.trained for s in shapes) * F32
    # room for the model, the state and the step (with FSDP2's buffers) recomputing some blocks beside 1 GiB of
    # slack, not for the step that keeps its activations
    capacity = GiB + model_bytes + state + (kept + recomputed) // 2
    run(tmp_path, monkeypatch, capacity, module)
    # the state is tiny: all of it fits beside a step that recomputes some blocks, so not all are recomputed
    recomputing = r"recomputing the first [12] of 3 Block blocks' activations \('auto'\): the step at a batch of"
    assert any(re.match(recomputing, line) for line in said.lines), said.lines


def test_a_step_that_cannot_fit_is_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    with pytest.raises(PlanDoesNotFit, match=r"needed at the step's peak: .*the step at a batch of"):
        run(tmp_path, monkeypatch, GiB + 1000)  # the slack and a kilobyte


class ReadsTheLoss(LoggingModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.seen = loss.item()  # a value on the host: fake tensors have none
        return loss


def test_a_step_that_cannot_be_traced_counts_no_activations_and_says_so(tmp_path, monkeypatch, said):
    run(tmp_path, monkeypatch, 4 * GiB, ReadsTheLoss())
    assert any("could not be traced on fake tensors" in line for line in said.lines), said.lines
    assert not any(line.startswith("the plan counts the step") for line in said.lines)


def test_fsdp2s_share_counts_two_neighbours_gathered_the_gradient_and_the_reduced_shards():
    model = TinyLM()
    units = plan_units(model)
    order = forward_order(model, units)
    assert order == ["emb", "blocks.0", "blocks.1", "blocks.2", "ln_f", "head"]
    block = 2 * 2 * tiny.DIM + (tiny.DIM * 3 * tiny.DIM + 3 * tiny.DIM) + (tiny.DIM * tiny.DIM + tiny.DIM) \
        + (tiny.DIM * 4 * tiny.DIM + 4 * tiny.DIM) + (4 * tiny.DIM * tiny.DIM + tiny.DIM)  # two norms, four linears
    head, ln_f = tiny.VOCAB * tiny.DIM, 2 * tiny.DIM
    assert block > 3 * head
    # backward reduces head, ln_f, blocks 2, 1, 0, emb. At its most when block 1 reduces: blocks 1 and 0 gathered (0
    # prefetched), block 1's unsharded gradient, a reduce-scatter input of a block (block 2's kept until block 1's is
    # made), and the reduced shards of the last four units to reduce: two whose copy may be pending (head, ln_f),
    # block 2's still held as `.grad`s, block 1's (one rank: a shard is the whole unit)
    assert REDUCED_IN_FLIGHT == 2
    assert gathered_bytes(model, units, 2, order) == (2 * block + 2 * block + head + ln_f + 2 * block) * 2
    # two ranks: each holds half of every reduced unit (their elements divide evenly); still block 1
    assert block % 2 == 0
    assert gathered_bytes(model, units, 2, order, world_size=2) == (4 * block + (head + ln_f + 2 * block) // 2) * 2


class TokensModule(pl.LightningDataModule):
    def train_dataloader(self):
        return token_loader(tiny.GLOBAL, batch_size=2)


def test_a_datamodules_loader_gives_the_batch(tmp_path, monkeypatch, said):
    with_accelerator(monkeypatch, 4 * GiB)
    monkeypatch.chdir(tmp_path)
    strategy = ZoffStrategy(start_method="fork", accelerator_state="none", accelerator_update_share="none")
    fit(LoggingModule(), TokensModule(), strategy, devices=1, max_steps=1)
    assert any(line.startswith(f"the plan counts the step at a batch of 2 x {tiny.SEQ} ") for line in said.lines), \
        said.lines


class LongerInTheHooks(LoggingModule):
    """Its batch hooks make each sequence twice as long before the transfer, and its targets after: the traced step must
    be the step the loop runs, at 4 x 32."""

    def on_before_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return torch.cat([x, x], dim=1), y

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x, torch.cat([y, y], dim=1)


def test_the_batch_hooks_run_before_the_trace(tmp_path, monkeypatch, said):
    with_accelerator(monkeypatch, 4 * GiB)
    monkeypatch.chdir(tmp_path)
    kept = step_bytes(LoggingModule(), False)
    strategy = ZoffStrategy(start_method="fork", accelerator_state="none", accelerator_update_share="none")
    fit(LongerInTheHooks(), token_loader(tiny.GLOBAL), strategy, devices=1, max_steps=1)
    counted = [line for line in said.lines if line.startswith("the plan counts the step at a batch of")]
    assert len(counted) == 1, said.lines
    # the line names the batch the loader's hook made; the count, a step twice as long: more than the plain one's
    assert counted[0].startswith(f"the plan counts the step at a batch of {BATCH} x {2 * tiny.SEQ} "), counted
    activations = re.search(r"\(activations ([\d.]+) MB", counted[0])
    assert activations is not None, counted
    assert float(activations.group(1)) * 1e6 > 1.5 * kept, (counted, kept)


# -- how many blocks "auto" recomputes ---------------------------------------------------------------------------


@pytest.mark.parametrize("guess", [1, 2, 3, 4])
def test_the_fewest_blocks_that_fit_from_any_guess(guess):
    asked = []

    def fits(n):
        asked.append(n)
        return n >= 3

    assert fewest_blocks(4, fits, guess) == 3
    assert len(asked) <= abs(guess - 3) + 2  # a walk from the guess, one block at a time


def test_the_linear_guess():
    # none recomputed: 100 bytes, all 4: 20, so 20 a block; 50 of room needs 3 blocks (40 saved gives 60, 60 gives 40)
    assert linear_guess(4, 100, 20, 50) == 3
    assert linear_guess(4, 100, 20, 100) == 1  # at least one: the step did not fit without
    assert linear_guess(4, 100, 100, 50) == 4  # nothing to save per block: all


def test_auto_recomputes_the_fewest_first_blocks_that_let_all_the_state_fit():
    blocks, trace, steps = four_blocks()
    no_state = [UnitShape("model", 0, 0, True)]

    def plan_with(capacity):
        return lambda step: plan_memory(no_state, OPTIONS, Machine(10**13, capacity), "none", model_bytes=0, step=step)

    # the GPU holds its slack (1 GiB) and a step between two recomputed blocks' and one's: two it is
    capacity = GiB + (steps[1].total + steps[2].total) // 2
    chosen = fewer_for_all_state(blocks, steps[0], steps[4], trace, plan_with(capacity))
    assert chosen is not None
    assert chosen[0] == 2
    assert chosen[1].total == steps[2].total
    assert [recomputes_activations(b) for b in blocks] == [True, True, False, False]
    # where even all four leave too little room for all the state: all of them, as before
    for block in blocks:
        set_recompute(block, True)
    with pytest.raises(PlanDoesNotFit):
        fewer_for_all_state(blocks, steps[0], steps[4], trace, plan_with(GiB + steps[4].total - 1))
