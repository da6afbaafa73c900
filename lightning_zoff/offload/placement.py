"""Which units keep their optimizer state on the accelerator and which on the host: the rules of the option
(`ZoffConfig` reads what the user wrote).

Each unit whose state lives on the accelerator takes its whole update (28 B/param of host traffic with fp32 moments)
off the host, the bottleneck. The accelerator takes the units the next forward needs first: the host's units are then
the last ones, whose gradients arrive first in backward and whose updates finish while the forward runs through the
first.

`accelerator_state`:
- ``"auto"`` (default): on a CUDA accelerator, only the units the host cannot hold start there; after the first
  optimizer step measured the accelerator's peak (activations, all-gathers, the state already there), as many more as
  fit with a margin of max(2 GiB, 5% of the device) left free move there (and back, should a later step's peak eat
  the margin). The memory plan (`memory_plan.py`) has the bytes.
- a fraction in [0, 1]: the first units in forward order, up to that share of the trained elements, from the start.
- ``"none"`` (or 0): all on the host.
On a CPU "accelerator" (tests) "auto" means "none": there is nothing to gain.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

GiB = 2**30


class Placement(enum.Enum):
    """Where a unit's master and moments live and its update runs."""

    HOST = "host"  # the fused CPU kernels; gradients come down, 16-bit parameters go up
    ACCELERATOR = "accelerator"  # torch ops next to the parameters


class Named(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def trained(self) -> int: ...


Unit = TypeVar("Unit", bound=Named)


def margin_bytes(total: int) -> int:
    """Accelerator memory "auto" leaves free: room for a longer batch and the allocator's fragmentation."""
    return max(2 * GiB, int(0.05 * total))


def first_by_fraction(units: Sequence[Unit], fraction: float) -> list[str]:
    """The first units (forward order) whose trained elements stay within `fraction` of all."""
    sizes = {u.name: u.trained for u in units}
    return first_that_fit(units, sizes, fraction * sum(sizes.values()) + 0.5)


def first_that_fit(units: Sequence[Unit], sizes: Mapping[str, float], limit: float) -> list[str]:
    """The first units (in the order given) whose `sizes` fit in `limit` together."""
    chosen, taken = [], 0.0
    for unit in units:
        if taken + sizes[unit.name] > limit:
            break
        chosen.append(unit.name)
        taken += sizes[unit.name]
    return chosen


def fewest_for_host(units: Sequence[Unit], host_sizes: Mapping[str, int], capacity: int) -> list[str]:
    """The first units (forward order) that must leave the host so that the rest fit in `capacity`."""
    remaining = sum(host_sizes[u.name] for u in units)
    chosen = []
    for unit in units:
        if remaining <= capacity:
            break
        chosen.append(unit.name)
        remaining -= host_sizes[unit.name]
    return chosen
