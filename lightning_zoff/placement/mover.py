"""The mechanism: moving a unit's state between the host and the accelerator as the plan and the policy say. Each
move is an exact copy that leaves nothing behind (`relocate`: the state copied, the unit's working buffers made anew
on its side by `make_buffers`, the old ones freed; nothing changes should it fail); the spare sets are made or freed
for the host's room after each; and what the units' tensors hold, per side (the memory report). The engine owns one
`StateMover` and moves units between steps only: no update is in flight while a unit moves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_zoff.placement.host_buffers import host_empty
from lightning_zoff.placement.plan import MemoryPlan, Placement
from lightning_zoff.placement.policy import back_for_room, fewer_for_accelerator, more_for_accelerator
from lightning_zoff.placement.staging_ring import StagingRing

if TYPE_CHECKING:  # the pipeline's types: the mover moves them, and loads none of the pipeline
    from lightning_zoff.offload.scheduler import SparePool
    from lightning_zoff.offload.unit_state import UnitState


@dataclass
class SpareSet:
    """A speculation's buffers: the state it writes and the 16-bit copy of its parameters (None for fp32 models, which
    send the master); `sent`: the copy of `out` to the accelerator that must end before `out` is written again. As many
    as the plan has room for (`MemoryPlan.spare_sets`), made here, lent by the scheduler's pool."""

    state: list[torch.Tensor]
    out: torch.Tensor | None
    sent: torch.cuda.Event | None = None

    def buffers(self) -> list[torch.Tensor]:
        return self.state + ([] if self.out is None else [self.out])


class StateMover:
    """Keeps each unit's state where `plan` says, and the plan in step with each move. `units`: the engine's list;
    `pool`: the spare sets' pool (None without overlap)."""

    def __init__(self, plan: MemoryPlan, units: list[UnitState], pool: SparePool | None, *, host: torch.device,
                 accelerator: torch.device, grad_sum_dtype: torch.dtype, moment_dtype: torch.dtype, pin: bool,
                 pin_state: bool = False) -> None:
        self.plan = plan
        self.units = units  # the engine's list
        self.pool = pool
        self.host, self.accelerator = host, accelerator
        self.grad_sum_dtype, self.moment_dtype, self.pin = grad_sum_dtype, moment_dtype, pin
        self.pin_state = pin_state  # host state pinned too: the accelerator runs a share of its updates
        self._spare_trained = 0  # the size the pool's sets are made for
        # the host units' shared landing and out buffer (`StateOptions.landing_ring`), sized with the pool
        self.ring = StagingRing(0, host, pin) if plan.options.landing_ring else None
        self.resize_pool()

    def device(self, placement: Placement) -> torch.device:
        return self.host if placement is Placement.HOST else self.accelerator

    def resize_pool(self) -> None:
        """Make or free spare sets until the pool holds the plan's, and size the staging ring (between steps)."""
        if self.ring is not None:
            self.ring.resize(self.plan.ring_bytes)
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
        state = [host_empty(n, dtype, self.host, pin=self.pin_state) for dtype in [torch.float32, *moments]]
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
                         landing_ring=self.ring is not None, pin=self.pin and placement is Placement.HOST,
                         pin_state=self.pin_state and placement is Placement.HOST)
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
        locals_ = [t for unit in self.units for t in unit.layout.local_shards]
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
        if self.ring is not None:
            held[Placement.HOST.value] += self.ring.nbytes
        return held


def relocate(unit: UnitState, placement: Placement, device: torch.device, *, grad_sum_dtype: torch.dtype, pin: bool,
             pin_state: bool = False, landing_ring: bool = False) -> None:
    """Move the unit's state to `device` (exact copies) and make its buffers there, freeing those it had; on failure
    nothing changes. Between windows only."""
    assert unit.at_rest
    before = (unit.state, unit.placement, unit.grad_sum, unit.grad_staging, unit.param_staging)
    try:
        unit.state = [host_empty(t.numel(), t.dtype, device, pin=pin_state).copy_(t) for t in unit.state]  # as built
        unit.placement = placement
        make_buffers(unit, device, sums_windows=unit.grad_sum is not None, grad_sum_dtype=grad_sum_dtype, pin=pin,
                     landing_ring=landing_ring)
    except BaseException:  # out of memory on the way: the unit stays as it was
        unit.state, unit.placement, unit.grad_sum, unit.grad_staging, unit.param_staging = before
        raise
    unit.grad_copied = unit.params_copied = unit.state_back = None


def make_buffers(unit: UnitState, device: torch.device, *, sums_windows: bool, grad_sum_dtype: torch.dtype,
                 pin: bool, landing_ring: bool = False) -> None:
    """The unit's working buffers next to its state (`plan.unit_buffers` has their sizes): the window's gradient sum;
    on the host, the buffer the gradient lands in and the one the 16-bit parameters leave from, unless the host units
    share the mover's staging ring (`landing_ring`: the landing and the update take their room there in turn)."""
    n, host = unit.layout.flat_numel, unit.placement is Placement.HOST
    unit.grad_sum = host_empty(n, grad_sum_dtype, device, pin and host).zero_() if sums_windows else None
    unit.grad_staging = host_empty(n, unit.param_dtype, device, pin) if host and not landing_ring else None
    unit.in_ring = host and landing_ring
    if not host:
        unit.param_staging = None
    elif unit.fp32_params:
        unit.param_staging = unit.master
    elif landing_ring:
        unit.param_staging = None
    elif unit.same_layout:
        assert unit.grad_staging is not None
        unit.param_staging = unit.grad_staging[: unit.master.numel()]
    else:
        unit.param_staging = host_empty(unit.master.numel(), unit.param_dtype, device, pin)
