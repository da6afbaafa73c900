"""Where each parameter's shard sits in its FSDP2 unit's flat reduced gradient.

FSDP2 reduce-scatters a unit's gradients into one flat tensor: each trainable parameter's local shard in parameter
order, each padded to ceil(dim0 / world) rows (zoff has FSDP2 reduce every parameter that requires a gradient, a
zero one for those that got none: `_compat.before_reduce`). Parameters that require no gradient (frozen) are not in
it. The host's gradient buffers mirror that layout, so a shard lands with a single copy.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_zoff._compat import unit_params
from lightning_zoff.placement import UnitShape
from lightning_zoff.sharding import padded_shard_numel


@dataclass(frozen=True)
class ParamSlot:
    param: nn.Parameter  # the sharded (DTensor) parameter FSDP2 owns
    offset: int  # start in the unit's flat shard
    numel: int  # elements of this rank's local shard
    padded_numel: int  # elements reserved in the flat shard (same on every rank)

    @property
    def local(self) -> torch.Tensor:
        return cast(DTensor, self.param).to_local()


@dataclass(frozen=True)
class UnitLayout:
    name: str
    slots: tuple[ParamSlot, ...]  # the parameters that require a gradient, in the flat reduced gradient's order
    flat_numel: int
    frozen: tuple[nn.Parameter, ...]  # sharded parameters that require no gradient: never reduced, never updated

    @property
    def params(self) -> list[nn.Parameter]:
        """Every sharded parameter of the unit: those in the flat gradient, then the frozen ones."""
        return [*(slot.param for slot in self.slots), *self.frozen]

    @property
    def local_shards(self) -> list[torch.Tensor]:
        """This rank's shard of each of `params`."""
        return [p.to_local() if isinstance(p, DTensor) else p for p in self.params]


def unit_layout(name: str, module: nn.Module, world_size: int) -> UnitLayout:
    slots, frozen, offset = [], [], 0
    for param in unit_params(module):
        if not param.requires_grad:
            frozen.append(param)
            continue
        padded = padded_shard_numel(param.shape, world_size)
        numel = cast(DTensor, param).to_local().numel()
        slots.append(ParamSlot(param, offset, numel, padded))
        offset += padded
    return UnitLayout(name, tuple(slots), offset, tuple(frozen))


def unit_layouts(units: list[tuple[str, nn.Module]], world_size: int, optimized: set[int]
                 ) -> list[tuple[UnitLayout, nn.Module]]:
    """The layouts of the units that hold parameters; `optimized` (ids of the optimizer's parameters) must be among
    them."""
    layouts = [(unit_layout(name, module, world_size), module) for name, module in units]
    layouts = [(layout, module) for layout, module in layouts if layout.params]
    missing = optimized - {id(p) for layout, _ in layouts for p in layout.params}
    if missing:
        raise ValueError(
            f"{len(missing)} parameter(s) of the optimizer are not parameters of the sharded model; zoff can only"
            " optimize the LightningModule's own parameters, passed after sharding (configure_optimizers)."
        )
    return layouts


def unit_shape(layout: UnitLayout, trained_ids: Container[int]) -> UnitShape:
    """A sharded unit's shape, as the plan counts it; `trained_ids`: ids of the parameters the optimizer trains."""
    trained = [s for s in layout.slots if id(s.param) in trained_ids]
    return UnitShape(layout.name, sum(s.padded_numel for s in trained), layout.flat_numel,
                     len(trained) == len(layout.slots))
