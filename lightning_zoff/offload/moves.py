"""Which units move between the host and the accelerator once a step has measured the accelerator: more there when
a step left room beside the margin, some back when one ate into it or ran out of memory. Each reads the memory plan
(`memory_plan.py`) and returns names; the `Placer` moves them."""

from __future__ import annotations

from lightning_zoff.offload.memory_plan import MemoryPlan, unit_buffers
from lightning_zoff.offload.placement import Placement, first_that_fit


def more_for_accelerator(plan: MemoryPlan, peak: int) -> list[str]:
    """The host's units (first in forward order) that fit on the accelerator beside a step that peaked at `peak` bytes
    (the state already there included) with the margin left free, their update's workspace counted."""
    capacity = plan.machine.accelerator_capacity
    if capacity is None:
        return []
    room = capacity - peak - plan.machine.accelerator_margin
    workspace_now = plan.accelerator_transient_bytes
    costs = {}
    for shape in plan.units_on(Placement.HOST):
        if shape.trained:
            state = sum(unit_buffers(shape, plan.options, Placement.ACCELERATOR).values())
            workspace = max(0, plan.options.workspace_bytes(shape.trained, plan.lion) - workspace_now)
            costs[shape.name] = state + workspace
    host_first = [s for s in plan.shapes if s.name in costs]
    return first_that_fit(host_first, costs, room)


def fewer_for_accelerator(plan: MemoryPlan, peak: int) -> list[str]:
    """The accelerator's units (last in forward order first) to move back to the host when a step that peaked at
    `peak` bytes left less than half the margin free, so that all of it is free again; empty otherwise."""
    capacity = plan.machine.accelerator_capacity
    if capacity is None or peak + plan.machine.accelerator_margin // 2 <= capacity:
        return []
    excess = peak + plan.machine.accelerator_margin - capacity
    host_room = plan.machine.host_capacity - plan.state_on(Placement.HOST)  # the spare sets make way
    chosen: list[str] = []
    for shape in reversed(plan.units_on(Placement.ACCELERATOR)):
        host_room -= sum(unit_buffers(shape, plan.options, Placement.HOST).values())
        if excess <= 0 or host_room < 0:
            break
        chosen.append(shape.name)
        excess -= sum(unit_buffers(shape, plan.options, Placement.ACCELERATOR).values())
    return chosen


def back_for_room(plan: MemoryPlan, nbytes: int) -> list[str]:
    """The accelerator's units (last in forward order first) whose state adds up to at least `nbytes` there (at least
    one unit), as many of them as the host has room for: what to move back after a step ran out of accelerator
    memory; empty when the host can take none."""
    host_room = plan.machine.host_capacity - plan.state_on(Placement.HOST)  # the spare sets make way
    chosen: list[str] = []
    freed = 0
    for shape in reversed(plan.units_on(Placement.ACCELERATOR)):
        host_room -= sum(unit_buffers(shape, plan.options, Placement.HOST).values())
        if host_room < 0 or (chosen and freed >= nbytes):
            break
        chosen.append(shape.name)
        freed += sum(unit_buffers(shape, plan.options, Placement.ACCELERATOR).values())
    return chosen
