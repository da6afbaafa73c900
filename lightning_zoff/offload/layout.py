"""Where each parameter's shard sits in its FSDP2 unit's flat reduced gradient.

FSDP2 reduce-scatters a unit's gradients into one flat tensor: each parameter's local shard in parameter order,
each padded to ceil(dim0 / world) rows. Our host buffers (master, moments, gradient sum) mirror that layout so a
gradient shard lands with a single copy and one run of parameters of the same param group is one contiguous
slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamSlot:
    param: nn.Parameter  # the sharded (DTensor) parameter FSDP2 owns
    offset: int  # start in the unit's flat shard
    numel: int  # elements of this rank's local shard
    padded_numel: int  # elements reserved in the flat shard (same on every rank)

    @property
    def local(self) -> torch.Tensor:
        return self.param.to_local()


@dataclass(frozen=True)
class UnitLayout:
    name: str
    slots: tuple[ParamSlot, ...]
    flat_numel: int


def padded_shard_numel(global_shape: torch.Size, world_size: int) -> int:
    rows = math.ceil(global_shape[0] / world_size) if len(global_shape) else 1
    return rows * math.prod(global_shape[1:])


def unit_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP2 manages for the unit `module`, in its reduce-scatter order."""
    state = module._get_fsdp_state()  # FSDP2's per-unit state; the only way to read its param order
    group = state._fsdp_param_group
    return [] if group is None else [fp.sharded_param for fp in group.fsdp_params]


def unit_layout(name: str, module: nn.Module, world_size: int) -> UnitLayout:
    slots, offset = [], 0
    for param in unit_params(module):
        padded = padded_shard_numel(param.shape, world_size)
        numel = param.to_local().numel()
        slots.append(ParamSlot(param, offset, numel, padded))
        offset += padded
    return UnitLayout(name, tuple(slots), offset)
