"""Where each unit's state lives, kept as the memory plan says: moves between steps (each leaving no copy behind), the
spare sets sized for the host's room after each, and what the engine's tensors hold. The engine owns one `Placer`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_zoff.offload.buffers import host_empty
from lightning_zoff.offload.layout import UnitLayout
from lightning_zoff.offload.memory_plan import (
    Machine,
    MemoryPlan,
    StateOptions,
    plan_memory,
    unit_shape,
)
from lightning_zoff.offload.moves import back_for_room, fewer_for_accelerator, more_for_accelerator
from lightning_zoff.offload.scheduler import SparePool
from lightning_zoff.offload.unit_state import Placement, SpareSet, UnitState, relocate

if TYPE_CHECKING:
    from lightning_zoff.config import ZoffConfig


def local(param: nn.Parameter) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def plan_for(layouts: list[tuple[UnitLayout, nn.Module]], forward_order: Sequence[str], group_of: dict[int, int],
             config: ZoffConfig, machine: Machine, *, moments: int, sums_windows: bool, masters_bytes: int
             ) -> MemoryPlan:
    """The memory plan of the engine's units (`forward_order`: their names as a forward enters them; `group_of`: the
    optimizer's param group of each trained parameter, by id)."""
    by_name = {layout.name: layout for layout, _ in layouts}
    params = [p for layout, _ in layouts for p in layout.params]
    options = StateOptions.of(config, param_bytes=params[0].element_size() if params else 2, moments=moments,
                              sums_windows=sums_windows)
    return plan_memory([unit_shape(by_name[name], group_of) for name in forward_order], options, machine,
                       config.accelerator_state if config.offload else "none",
                       model_bytes=sum(local(p).nbytes for p in params), lion=moments == 1,
                       masters_bytes=masters_bytes, all_on_accelerator=not config.offload)


class Placer:
    def __init__(self, plan: MemoryPlan, units: list[UnitState], pool: SparePool | None, *, host: torch.device,
                 accelerator: torch.device, grad_sum_dtype: torch.dtype, moment_dtype: torch.dtype, pin: bool) -> None:
        self.plan = plan
        self.units = units  # the engine's list
        self.pool = pool  # None without overlap
        self.host, self.accelerator = host, accelerator
        self.grad_sum_dtype, self.moment_dtype, self.pin = grad_sum_dtype, moment_dtype, pin
        self._spare_trained = 0  # the size the pool's sets are made for
        self.resize_pool()

    def device(self, placement: Placement) -> torch.device:
        return self.host if placement is Placement.HOST else self.accelerator

    def resize_pool(self) -> None:
        """Make or free spare sets until the pool holds the plan's (between steps)."""
        if self.pool is None:
            return
        shape = self.plan.spare_shape
        trained = 0 if shape is None else shape.trained
        if trained != self._spare_trained:
            self.pool.resize(0, self._spare_set)  # sets of another size serve no unit now
            self._spare_trained = trained
        self.pool.resize(self.plan.spare_sets, self._spare_set)

    def _spare_set(self) -> SpareSet:
        n = self._spare_trained
        moments = [self.moment_dtype] * self.plan.options.moments
        state = [host_empty(n, dtype, self.host, pin=False) for dtype in [torch.float32, *moments]]
        param_dtype = self.units[0].param_dtype if self.units else torch.float32
        out = None if param_dtype == torch.float32 else host_empty(n, param_dtype, self.host, self.pin)
        return SpareSet(state, out)

    def move(self, names: Sequence[str], placement: Placement) -> list[str]:
        """Move the named units' state to `placement`, in that order (exact copies; between steps, with no update in
        flight); the names moved. Should the accelerator run out of memory on the way, the units not moved yet stay
        where they are."""
        by_name = {unit.layout.name: unit for unit in self.units}
        names = [name for name in names if by_name[name].placement is not placement]
        if placement is Placement.HOST:  # room for them first: the spare sets the host no longer has room for go
            self.plan = self.plan.moved(names, placement)
            self.resize_pool()
        moved = []
        for name in names:
            try:
                relocate(by_name[name], placement, self.device(placement), grad_sum_dtype=self.grad_sum_dtype,
                         pin=self.pin and placement is Placement.HOST)
            except torch.OutOfMemoryError:
                break  # the estimate was off: this unit stays as it was (relocate changes nothing on failure)
            moved.append(name)
        self.plan = self.plan.with_placement({**self.plan.placement, **{n: by_name[n].placement for n in names}})
        self.resize_pool()
        return moved

    def place_by_peak(self, peak: int, forward_order: Sequence[str], more: bool) -> tuple[list[str], list[str]]:
        """After a step whose accelerator memory peaked at `peak` bytes (the state there included): when the step ate
        into the margin, move the accelerator's last units in `forward_order` back; else, with `more`, the host's
        first units to the accelerator while the margin stays free. The names moved (there, back)."""
        order = {name: i for i, name in enumerate(forward_order)}
        self.plan = self.plan.reordered(sorted(self.plan.shapes, key=lambda s: order[s.name]))
        back = fewer_for_accelerator(self.plan, peak)
        if back:
            return [], self.move(back, Placement.HOST)
        there = more_for_accelerator(self.plan, peak) if more else []
        return self.move(there, Placement.ACCELERATOR), []

    def make_room(self) -> list[str]:
        """After a step ran the accelerator out of memory: move the state of its last units back to the host, a margin's
        worth (at least one unit) where the host has room; the names moved."""
        return self.move(back_for_room(self.plan, self.plan.machine.accelerator_margin), Placement.HOST)

    def summary(self) -> dict[str, tuple[int, int]]:
        """Per placement ("host", "accelerator"): units with trained parameters, and their state's bytes there."""
        summary = {p.value: (0, 0) for p in Placement}
        for unit in self.units:
            if unit.trained:
                size = sum(self.plan.buffers(unit.layout.name).values())
                count, total = summary[unit.placement.value]
                summary[unit.placement.value] = (count + 1, total + size)
        return summary

    def report(self) -> dict[str, float]:
        """The plan's bytes by kind and side, with this rank's share of the model."""
        locals_ = [local(p) for unit in self.units for p in unit.layout.params]
        local_numel = sum(t.numel() for t in locals_)
        report = {"local_params": local_numel, **self.plan.report()}
        report["accelerator_params"] = sum(t.nbytes for t in locals_)
        report["accelerator_bytes_per_param"] = report["accelerator_params"] / max(local_numel, 1)
        report["host_bytes_per_param"] = report["host_total"] / max(local_numel, 1)
        return report

    def held_bytes(self) -> dict[str, int]:
        """What the engine's tensors hold now, per side (between steps; what the plan says they hold)."""
        held = {placement.value: 0 for placement in Placement}
        for unit in self.units:
            held[unit.placement.value] += sum(t.nbytes for t in unit.buffers())
        if self.pool is not None:
            held[Placement.HOST.value] += sum(t.nbytes for t in self.pool.free_buffers())
        return held
