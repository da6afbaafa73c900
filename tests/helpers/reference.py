"""What the tiny transformer's training on several ranks should give, computed on one process with the whole model in
fp32 and torch's own AdamW: plain torch, the reference of the Lightning-free tests and of the doors' contract test."""

from __future__ import annotations

import torch

from helpers.tiny import TinyLM, adamw, loss_of, micro_batch

SEED = 7  # the model's initialisation, as the runs under test seed it


def train_on_one_process(steps: int, accumulate: int, max_norm: float, world_size: int = 2
                         ) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """`steps` optimizer steps over micro-batches `micro_batch(i, rank, world_size)`, the gradient each step's mean over
    the ranks and its window, clipped to `max_norm`: each micro-batch's loss on each rank, and the final weights."""
    torch.manual_seed(SEED)
    model = TinyLM()
    optimizer = adamw(model)
    losses = []
    for step in range(steps):
        for micro in range(accumulate):
            index = step * accumulate + micro
            rank_losses = [loss_of(model, *micro_batch(index, rank, world_size)) for rank in range(world_size)]
            (sum(rank_losses) / (world_size * accumulate)).backward()
            losses.append([loss.item() for loss in rank_losses])
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
    return losses, model.state_dict()
