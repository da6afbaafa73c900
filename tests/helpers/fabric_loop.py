"""A plain Fabric training loop over the tiny transformer, the same under zoff and under Fabric's DDP, and the same
data for the Trainer: micro-batch `i` is `tiny.micro_batch(i, ...)`, the global batch `INPUTS[i * GLOBAL : (i + 1) *
GLOBAL]` split evenly among the ranks, so that a run on 2 ranks and one on 3 see the same global mean loss and
gradient."""

from __future__ import annotations

import json
from collections.abc import Iterator

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Sampler, TensorDataset

from helpers.tiny import GLOBAL, INPUTS, TARGETS, loss_of, micro_batch
from helpers.tiny_module import TinyModule


class FabricTiny(TinyModule):
    """TinyModule with a forward (Fabric calls the module) and the all-ranks mean of each micro-batch's loss."""

    def __init__(self) -> None:
        super().__init__(step_lr=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        loss = loss_of(self, *batch)
        self.losses.append(self.all_gather(loss.detach()).mean().item())
        return loss


class RankRows(Sampler):
    """The rows `micro_batch` deals this rank, read in the rank (the loader is built before the ranks fork): for a
    Trainer with `use_distributed_sampler=False`."""

    def __init__(self, rows: int, world_size: int) -> None:
        self.rows, self.world_size = rows, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(dist.get_rank(), self.rows, self.world_size))

    def __len__(self) -> int:
        return self.rows // self.world_size


def trainer_loader(first_step: int, steps: int, world_size: int) -> DataLoader:
    """The same micro-batches for a Trainer (one per step), from optimizer step `first_step` on."""
    rows = slice(first_step * GLOBAL, (first_step + steps) * GLOBAL)
    return DataLoader(TensorDataset(INPUTS[rows], TARGETS[rows]), batch_size=GLOBAL // world_size,
                      sampler=RankRows(steps * GLOBAL, world_size))


def train(fabric: Fabric, steps: int, accumulate: int = 1, max_norm: float = 0.5, load: str | None = None,
          save: str | None = None, save_at: int | None = None, weights_to: str | None = None, apart: bool = False,
          empty_init: bool = False, memory_to: str | None = None, **optimizer_hints: bool) -> list[list[float]]:
    """`steps` optimizer steps, from a checkpoint if `load`; saves after `save_at` steps to `save`, and the final fp32
    weights to the file `weights_to`. Returns each micro-batch's loss on every rank.

    `apart`: LitGPT's scripts' order, `model = fabric.setup(module)`, then the optimizer made over the set-up model's
    parameters and `fabric.setup_optimizers(optimizer)`, instead of `fabric.setup(module, optimizer)`; `empty_init`:
    the module built under `fabric.init_module(empty_init=True)`; `memory_to`: a file for rank 0's memory report;
    `optimizer_hints`: torch's `fused=`/`foreach=` for AdamW."""
    fabric.seed_everything(7)
    with fabric.init_module(empty_init=empty_init):
        module = FabricTiny()
    if empty_init:
        fabric.seed_everything(7)  # the units' initialisation draws from here on every rank
    if apart:
        model = fabric.setup(module)
        optimizer = fabric.setup_optimizers(module.configure_optimizers(**optimizer_hints))
    else:
        model, optimizer = fabric.setup(module, module.configure_optimizers(**optimizer_hints))
    if memory_to is not None and fabric.is_global_zero:
        with open(memory_to, "w") as file:
            json.dump(fabric.strategy.memory_report, file)
    state = {"model": model, "optimizer": optimizer, "global_step": 0}  # the Trainer's name for it
    if load is not None:
        fabric.load(load, state)
    first, losses = state["global_step"], []
    for step in range(first, first + steps):
        for micro in range(accumulate):
            x, y = fabric.to_device(micro_batch(step * accumulate + micro, fabric.global_rank, fabric.world_size))
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = loss_of(model, x, y)
                fabric.backward(loss / accumulate)
            losses.append(fabric.all_gather(loss.detach()).tolist())  # every rank's
        fabric.clip_gradients(model, optimizer, max_norm=max_norm)
        optimizer.step()
        optimizer.zero_grad()
        state["global_step"] = step + 1
        if save is not None and step + 1 == save_at:
            fabric.save(save, state)
    if weights_to is not None:
        full = getattr(fabric.strategy, "full_state_dict", None)  # zoff's, a collective; DDP's module holds them all
        weights = full() if full is not None else module.state_dict()
        if fabric.is_global_zero:
            torch.save(weights, weights_to)
    return losses  # small: what rank 0 returns goes through a pipe the main process reads once every rank is done
