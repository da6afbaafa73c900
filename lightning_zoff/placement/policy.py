"""The policy: which units keep their optimizer state on the accelerator and which on the host, at setup and after a
step. `plan_memory` is the one entry point that plans: it places every unit by the `accelerator_state` option, sizes
the spare sets and refuses what does not fit; the functions after it choose the units a measured step moves.

Each unit whose state lives on the accelerator takes its whole update (28 B/param of host traffic with fp32 moments)
off the host, the bottleneck. The accelerator takes the units the next forward needs first: the host's units are then
the last ones, whose gradients arrive first in backward and whose updates finish while the forward runs through the
first.

`accelerator_state` (as `config.parse_accelerator_state` reads what the user wrote):
- ``"auto"`` (default): on a CUDA accelerator, only the units the host cannot hold start there; after the first
  optimizer step measured the accelerator's peak (activations, all-gathers, the state already there), as many more as
  fit with a margin of max(2 GiB, 5% of the device) left free move there (and back, should a later step's peak eat
  the margin). The plan (`plan.py`) has the bytes.
- a fraction in [0, 1]: the first units in forward order, up to that share of the trained elements, from the start.
- ``"none"`` (or 0): all on the host.
On a CPU "accelerator" (tests) "auto" means "none": there is nothing to gain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from lightning_zoff.placement.machine import Machine, size
from lightning_zoff.placement.plan import MemoryPlan, Placement, StateOptions, StepMemory, UnitShape, unit_buffers
from lightning_zoff.placement.refusal import PlanDoesNotFit, refusal

# -- at setup ------------------------------------------------------------------------------------------------------


def plan_memory(shapes: Sequence[UnitShape], options: StateOptions, machine: Machine, accelerator_state: str | float,
                *, model_bytes: int, lion: bool = False, masters_bytes: int = 0,
                all_on_accelerator: bool = False, step: StepMemory | None = None) -> MemoryPlan:
    """Place every unit (`shapes` in forward order) and size the spare sets; raise `PlanDoesNotFit` when the machine
    cannot hold the result (`masters_bytes`: the fp32 copies the state is built from, held meanwhile; `step`: the
    step's own memory on the accelerator, where a batch was traced).

    `accelerator_state`: "none" keeps all state on the host; a fraction puts the first units in forward order up to that
    share of the trained elements on the accelerator; "auto" (on a GPU) puts there only the first units the host cannot
    hold (the rest may follow once a step measured the accelerator's peak: `more_for_accelerator`)."""
    base = MemoryPlan(tuple(shapes), options, {}, machine, model_bytes, lion, step=step)
    plan = place(base, "all" if all_on_accelerator else accelerator_state)
    problems = plan.problems(masters_bytes)
    if problems and options.ring_only_to_fit and options.with_ring().landing_ring:  # no buffer per host unit: the ring
        return plan_memory(shapes, options.with_ring(), machine, accelerator_state, model_bytes=model_bytes, lion=lion,
                           masters_bytes=masters_bytes, all_on_accelerator=all_on_accelerator, step=step)
    if problems:
        fits = options_that_fit(plan, accelerator_state, masters_bytes)
        raise PlanDoesNotFit(refusal(plan, problems, fits, masters_bytes))
    return plan


def place(plan: MemoryPlan, accelerator_state: str | float) -> MemoryPlan:
    """`plan` with its units placed by `accelerator_state` (or "all" on the accelerator) and its spare sets sized."""
    shapes = plan.shapes
    plan = replace(plan, placement={s.name: Placement.HOST for s in shapes})
    on_accelerator: list[str]
    if accelerator_state == "all":
        on_accelerator = [s.name for s in shapes]
    elif accelerator_state == "none":
        on_accelerator = []
    elif isinstance(accelerator_state, float):
        on_accelerator = first_by_fraction(shapes, accelerator_state)
    elif plan.machine.accelerator_capacity is None:  # "auto" on a CPU accelerator: nothing to gain
        on_accelerator = []
    else:
        sizes = {s.name: sum(unit_buffers(s, plan.options, Placement.HOST).values()) for s in shapes}
        building = max((4 * s.trained for s in shapes), default=0)  # one unit's fp32 copy while its state is made
        on_accelerator = fewest_for_host(shapes, sizes, plan.machine.host_capacity - building - plan.ring_bound)
    return plan.moved(on_accelerator, Placement.ACCELERATOR)


def options_that_fit(plan: MemoryPlan, accelerator_state: str | float, masters_bytes: int
                     ) -> list[tuple[str, MemoryPlan]]:
    """For a plan that does not fit: the options that would (checked by placing anew), each with its plan; bf16
    moments first, then the first other `accelerator_state` that fits, then the largest smaller batch that fits (its
    activations scaled from the traced one's)."""
    options = plan.options
    fits = []
    if options.moment_bytes == 4:
        smaller = place(replace(plan, options=replace(options, moment_bytes=2)), accelerator_state)
        if not smaller.problems(masters_bytes):
            fits.append(("optimizer_state_dtype='bf16' (moments in 2 bytes each)", smaller))
    for state in ("auto", 0.25, 0.5, 0.75, 1.0):
        placed = place(plan, state)
        if state != accelerator_state and not placed.problems(masters_bytes):
            fits.append((f"accelerator_state={state!r}", placed))
            break
    step = plan.step
    if step is not None:
        for samples in range(step.samples - 1, 0, -1):
            smaller = place(replace(plan, step=step.at_samples(samples)), accelerator_state)
            if not smaller.problems(masters_bytes):
                fits.append((f"a batch of {samples} (about {size(smaller.step_bytes)} for the step)", smaller))
                break
    return fits


def first_by_fraction(units: Sequence[UnitShape], fraction: float) -> list[str]:
    """The first units (forward order) whose trained elements stay within `fraction` of all."""
    sizes = {u.name: u.trained for u in units}
    return first_that_fit(units, sizes, fraction * sum(sizes.values()) + 0.5)


def first_that_fit(units: Sequence[UnitShape], sizes: Mapping[str, float], limit: float) -> list[str]:
    """The first units (in the order given) whose `sizes` fit in `limit` together."""
    chosen, taken = [], 0.0
    for unit in units:
        if taken + sizes[unit.name] > limit:
            break
        chosen.append(unit.name)
        taken += sizes[unit.name]
    return chosen


def fewest_for_host(units: Sequence[UnitShape], host_sizes: Mapping[str, int], capacity: int) -> list[str]:
    """The first units (forward order) that must leave the host so that the rest fit in `capacity`."""
    remaining = sum(host_sizes[u.name] for u in units)
    chosen = []
    for unit in units:
        if remaining <= capacity:
            break
        chosen.append(unit.name)
        remaining -= host_sizes[unit.name]
    return chosen


def accelerator_holds_all(plan: MemoryPlan) -> bool:
    """Whether the accelerator could hold every unit's state beside the model, the step (where traced) and the margin:
    where it cannot, the host takes state, and memory the activations free on the accelerator is worth more as state
    there than the recomputation costs (the host's update, not the accelerator, sets the pace)."""
    capacity = plan.machine.accelerator_capacity
    if capacity is None:
        return True
    return plan.with_placement({s.name: Placement.ACCELERATOR for s in plan.shapes}).accelerator_need <= capacity


# -- after a step: the moves a measured peak asks for (the mover makes them) ----------------------------------------


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


def host_room_for_units(plan: MemoryPlan) -> int:
    """What the host has room for beside its units: the spare sets make way, the staging ring may grow to its size
    for every unit."""
    return plan.machine.host_capacity - plan.state_on(Placement.HOST) - plan.ring_bound


def fewer_for_accelerator(plan: MemoryPlan, peak: int) -> list[str]:
    """The accelerator's units (last in forward order first) to move back to the host when a step that peaked at
    `peak` bytes left less than half the margin free, so that all of it is free again; empty otherwise."""
    capacity = plan.machine.accelerator_capacity
    if capacity is None or peak + plan.machine.accelerator_margin // 2 <= capacity:
        return []
    excess = peak + plan.machine.accelerator_margin - capacity
    host_room = host_room_for_units(plan)
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
    host_room = host_room_for_units(plan)
    chosen: list[str] = []
    freed = 0
    for shape in reversed(plan.units_on(Placement.ACCELERATOR)):
        host_room -= sum(unit_buffers(shape, plan.options, Placement.HOST).values())
        if host_room < 0 or (chosen and freed >= nbytes):
            break
        chosen.append(shape.name)
        freed += sum(unit_buffers(shape, plan.options, Placement.ACCELERATOR).values())
    return chosen
