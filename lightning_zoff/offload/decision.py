"""The step's decision, the same on every rank: from the units' sums of squares and used-flags to skip or update,
with one scale for the whole step."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_zoff.offload.unit_state import Phase, UnitState
from lightning_zoff.optim.rules import GroupHyperparams


@dataclass(frozen=True)
class StepOutcome:
    grad_norm: float  # of the averaged, unclipped gradient
    clip_coef: float  # applied to the gradient (1.0 when not clipped)
    skipped: bool  # non-finite gradient: nothing changed


@dataclass(frozen=True)
class Decision:
    skipped: bool
    scale: float  # of the summed, loss-scaled gradient: 1/world x 1/loss scale x clip factor
    hyper: tuple[GroupHyperparams, ...]
    used: dict[UnitState, list[bool]]  # per trained parameter of each unit: some rank gave it a gradient


def decide(units: list[UnitState], optimizer: torch.optim.Optimizer, max_norm: float | None, *, world_size: int,
           loss_scale: float, sumsq: Callable[[UnitState], float]) -> tuple[Decision, StepOutcome]:
    """`units`: those with a gradient in this window (READY, or SUMMING when it came only in earlier micro-batches,
    whose sum of squares `sumsq(unit)` takes now). Clears the units' used-flags for the next window.

    The host gradients are sums over ranks of the loss-scaled gradients: the true norm divides by both."""
    sq = torch.zeros((), dtype=torch.float64)
    for unit in units:  # in unit order on every path, so the sum has the same bits
        if unit.phase is Phase.SUMMING:
            unit.sumsq = sumsq(unit)
        assert unit.sumsq is not None  # READY units have theirs
        sq += unit.sumsq
    # with the sum of squares, every trained parameter's "got a gradient here" flag: summed, "on some rank"
    flags = [float(unit.used[p.slot_index]) for unit in units for p in unit.trained]
    reduced = torch.tensor([sq.item(), *flags], dtype=torch.float64)
    if dist.is_initialized() and world_size > 1:
        dist.all_reduce(reduced)  # a CPU tensor: gloo, also under "cpu:gloo,cuda:nccl"
    global_flags = iter((reduced[1:] > 0).tolist())
    used = {unit: [next(global_flags) for _ in unit.trained] for unit in units}
    for unit in units:
        unit.used = [False] * len(unit.used)
    norm = math.sqrt(reduced[0].item()) / (world_size * loss_scale)
    skipped = not math.isfinite(norm)  # inf or NaN anywhere (fp16 overflow included): change nothing
    clip_coef = 1.0
    if not skipped and max_norm is not None and max_norm > 0:
        clip_coef = min(1.0, max_norm / (norm + 1e-6))
    decision = Decision(skipped, clip_coef / (world_size * loss_scale),
                        tuple(GroupHyperparams.of(g) for g in optimizer.param_groups), used)
    return decision, StepOutcome(norm, clip_coef, skipped)
