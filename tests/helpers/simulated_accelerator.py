"""The setup of a rank that plans for an accelerator of a given size, a CPU standing in for it (forked ranks inherit
the patches), the lines zoff logged there, and a 4-block model traced at every count of recomputed blocks: what the
tests of the traced step and of "auto"'s recompute share."""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from helpers import tiny
from helpers.tiny import TinyLM, token_loader
from lightning_zoff._compat import set_recompute
from lightning_zoff.placement import Machine, rank as rank_memory
from lightning_zoff.placement.fsdp_buffers import UnitBuffers
from lightning_zoff.placement.plan import StepMemory
from lightning_zoff.placement.rank import gathered_bytes
from lightning_zoff.placement.step_trace import StepProbe, measure_step, trace_step, trace_step_work
from lightning_zoff.sharding import checkpoint_activations
from lightning_zoff.units import forward_order, plan_units

CPU = torch.device("cpu")


class LoggingModule(pl.LightningModule):
    """The tiny transformer trained as users write it: the loss logged, no value read on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM()

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.model(batch[0]).float().flatten(0, 1), batch[1].flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return tiny.adamw(self)


class Said:
    """zoff's lines, as the rank logged them: the rank is a forked process, so they go through a file."""

    def __init__(self, path) -> None:
        self.path = path

    @property
    def lines(self) -> list[str]:
        text = self.path.read_text() if self.path.exists() else ""
        return [re.sub(r"^zoff ranks? [\d-]+: ", "", line) for line in text.splitlines()]


def with_accelerator(monkeypatch, capacity: int) -> None:
    """The rank plans for an accelerator of `capacity` bytes (the CPU stands in for it)."""
    real = rank_memory.measure_machine

    def measured(group, loader_workers=0):
        return Machine(real(group, loader_workers).host_available, capacity, loader_workers)

    monkeypatch.setattr(rank_memory, "measure_machine", measured)


def step_bytes(module: LoggingModule, recompute: bool) -> int:
    batch = next(iter(token_loader(tiny.GLOBAL)))
    probe = StepProbe(lambda: batch, lambda b: tiny.loss_of(module.model, *b), contextlib.nullcontext)
    if recompute:
        checkpoint_activations(module, {tiny.Block})
    return trace_step(module, probe, batch, CPU, torch.float32)


def step_total(module: LoggingModule, recompute: bool, world_size: int = 1) -> int:
    """The step as a rank's plan counts it at setup (`rank.py`): traced with FSDP2's buffers beside the activations,
    the most held at one moment."""
    batch = next(iter(token_loader(tiny.GLOBAL)))
    probe = StepProbe(lambda: batch, lambda b: tiny.loss_of(module.model, *b), contextlib.nullcontext)
    if recompute:
        checkpoint_activations(module, {tiny.Block})
    units = plan_units(module)
    order = forward_order(module, units)
    gathered = gathered_bytes(module, units, 4, order, world_size)
    buffers = UnitBuffers.of(module, units, 4, order, world_size)
    step = measure_step(module, probe, CPU, torch.float32, gathered, buffers)
    assert step is not None
    return step.total


def four_blocks() -> tuple[list[nn.Module], Callable[[], StepMemory], list[StepMemory]]:
    """A 4-block tiny LM with recompute installed switched off: its blocks, a trace of its step as the switches
    stand, and the steps traced with the first 0 to 4 blocks recomputed (each smaller than the one before)."""
    model = TinyLM(n_blocks=4)
    blocks = checkpoint_activations(model, {tiny.Block}, recompute=False)
    batch = (torch.zeros(4, tiny.SEQ, dtype=torch.long), torch.zeros(4, tiny.SEQ, dtype=torch.long))
    probe = StepProbe(lambda: batch, lambda b: tiny.loss_of(model, *b), contextlib.nullcontext)

    def trace() -> StepMemory:
        work = trace_step_work(model, probe, batch, CPU, torch.float32)
        return StepMemory(work.activations, 0, "a batch", samples=4, flops=work.flops)

    steps = []
    for n in range(5):
        for i, block in enumerate(blocks):
            set_recompute(block, i < n)
        steps.append(trace())
    assert all(a.total > b.total for a, b in itertools.pairwise(steps))  # each block recomputed saves
    return blocks, trace, steps
