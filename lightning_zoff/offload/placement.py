"""Which units keep their optimizer state on the accelerator and which on the host.

Each unit whose state lives on the accelerator takes its whole update (28 B/param of host traffic with fp32
moments) off the host, the bottleneck. The accelerator takes the units the next forward needs first: the host's units
are then the last ones, whose updates finish while the forward runs through the first.

`accelerator_state`:
- ``"auto"`` (default): on a CUDA accelerator, after the first optimizer step measured its peak (activations,
  all-gathers, the state already there), as many more units as fit in the free memory left after a margin of
  max(2 GiB, 5% of the device) move to it. Before that step, only the units the host cannot hold start there.
- a fraction in [0, 1]: the first units in forward order, up to that share of the trained elements, from the start.
- ``"none"`` (or 0): all on the host, as without this option.
On a CPU "accelerator" (tests) "auto" means "none": there is nothing to gain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lightning_zoff.offload.budget import host_bytes
from lightning_zoff.offload.layout import UnitLayout

GiB = 2**30


@dataclass(frozen=True)
class UnitCost:
    name: str
    trained: int  # elements of this rank's state
    accelerator_bytes: int  # its state and buffers if placed on the accelerator
    host_bytes: int  # its state and buffers if placed on the host


def parse_accelerator_state(value: object) -> str | float:
    """"auto", "none" or a fraction in [0, 1], as the user may write it (YAML gives strings and numbers)."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "none"):
        return value.strip().lower()
    try:
        fraction = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        fraction = -1.0
    if isinstance(value, bool) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"accelerator_state={value!r}; choose 'auto', 'none' or a fraction of the optimizer state"
                         " between 0 and 1 (e.g. 0.5: the first half of the model's units keep theirs on the GPU).")
    return "none" if fraction == 0.0 else fraction


def margin_bytes(total: int) -> int:
    """Accelerator memory left free by "auto": room for a longer batch and the allocator's fragmentation."""
    return max(2 * GiB, int(0.05 * total))


def first_by_fraction(costs: Sequence[UnitCost], fraction: float) -> list[str]:
    """The first units (forward order) whose trained elements stay within `fraction` of all."""
    return _first_within(costs, lambda c: c.trained, fraction * sum(c.trained for c in costs) + 0.5)


def first_that_fit(costs: Sequence[UnitCost], free_bytes: int) -> list[str]:
    """The first units (forward order) whose accelerator bytes fit in `free_bytes` together."""
    return _first_within(costs, lambda c: c.accelerator_bytes, free_bytes)


def _first_within(costs: Sequence[UnitCost], size: Callable[[UnitCost], float], limit: float) -> list[str]:
    chosen, taken = [], 0.0
    for cost in costs:
        if taken + size(cost) > limit:
            break
        chosen.append(cost.name)
        taken += size(cost)
    return chosen


def fewest_for_host(costs: Sequence[UnitCost], host_bytes: int) -> list[str]:
    """The first units (forward order) that must leave the host so that the rest fit in `host_bytes`."""
    remaining = sum(c.host_bytes for c in costs)
    chosen = []
    for cost in costs:
        if remaining <= host_bytes:
            break
        chosen.append(cost.name)
        remaining -= cost.host_bytes
    return chosen


def unit_costs(layouts: Sequence[UnitLayout], group_of: dict[int, int], *, param_bytes: int, moment_bytes: int,
               second_moment: bool, overlap: bool, accum_bytes: int) -> list[UnitCost]:
    """What each unit's state and buffers take on either side (`accum_bytes`: of the window sum, 0 without one)."""
    costs = []
    for layout in layouts:
        trained = sum(s.padded_numel for s in layout.slots if id(s.param) in group_of)
        state = trained * (4 + moment_bytes * (2 if second_moment else 1))
        staging = layout.flat_numel * param_bytes + (0 if param_bytes == 4 else trained * param_bytes)
        on_accelerator = state + staging + layout.flat_numel * accum_bytes
        on_host = host_bytes(trained, layout.flat_numel, param_bytes=param_bytes, second_moment=second_moment,
                             overlap=overlap, accum_bytes=accum_bytes, moment_bytes=moment_bytes)
        costs.append(UnitCost(layout.name, trained, on_accelerator, on_host))
    return costs


def initial_placement(costs: Sequence[UnitCost], accelerator_state: str | float, *, accelerator_is_cpu: bool,
                      host_capacity: int | None) -> list[str]:
    """The units (names) whose state starts on the accelerator; `costs` in forward order."""
    if accelerator_state == "none" or not costs:
        return []
    if isinstance(accelerator_state, float):
        return first_by_fraction(costs, accelerator_state)
    if accelerator_is_cpu or host_capacity is None:
        return []
    return fewest_for_host(costs, host_capacity)  # "auto": the rest joins them after the first step


@dataclass(frozen=True)
class AcceleratorRoom:
    total: int  # what this process may use (a per-process memory fraction counts)
    peak: int  # the most the caching allocator held so far
    margin: int
    free: int  # for more state: total - peak - margin, and no more than the device has free

    def describe(self) -> str:
        return (f"the first step peaked at {self.peak / 1e9:.1f} of {self.total / 1e9:.1f} GB; a margin of"
                f" {self.margin / 1e9:.1f} GB stays free")


def accelerator_room(device: torch.device) -> AcceleratorRoom:
    """How much more optimizer state a CUDA device can take after what ran on it so far."""
    device_free, device_total = torch.cuda.mem_get_info(device)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    total = int(device_total * (get_fraction(device) if get_fraction is not None else 1.0))
    peak = torch.cuda.max_memory_reserved(device)
    idle_in_cache = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    margin = margin_bytes(total)
    free = min(total - peak, device_free + idle_in_cache) - margin
    return AcceleratorRoom(total, peak, margin, max(0, free))
