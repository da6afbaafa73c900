"""FSDP2's buffers over one micro-batch's backward, moment by moment, for the step's trace (`step_trace.py`): which
units are gathered, which gradients are held unsharded, which reduce-scatter input and reduced shards are alive, as the
trace's backward hands each parameter its gradient. Added to the activations alive at the same moment, it gives the
step's peak, where the two peaks (the activations' near the start of backward, FSDP2's where units reduce) would
otherwise be added though they happen apart.

The same buffers as `rank.gathered_bytes` counts at its most (a unit's reduce: it and the next unit gathered, its
gradient, a reduce-scatter input, the reduced shards of the last `REDUCED_IN_FLIGHT` + 2 units); in forward, a unit and
the next one gathered. With `reshard_after_forward=False` (`kept`) a unit stays gathered from its forward until it
reduces in backward: in forward every unit counts (the most, reached at its end), in backward every unit not yet
reduced."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_zoff.placement.plan import REDUCED_IN_FLIGHT
from lightning_zoff.sharding import owned_params
from lightning_zoff.units import Unit


@dataclass(frozen=True)
class UnitBuffers:
    """The units as FSDP2's buffers see them, in forward order: each one's gathered bytes, this rank's reduced shard
    of it, how many of its parameters get a gradient, and the unit of each parameter (by `id`)."""

    sizes: tuple[int, ...]
    shards: tuple[int, ...]
    trained: tuple[int, ...]
    unit_of: dict[int, int]
    kept: bool = False  # each unit gathered from its forward until it reduces (reshard_after_forward=False)

    @classmethod
    def of(cls, model: nn.Module, units: list[Unit], param_bytes: int, order: Sequence[str],
           world_size: int = 1, kept: bool = False) -> UnitBuffers:
        taken: dict[str, torch.Tensor] = {}
        owned = {}
        for unit in units:  # inner units first: a unit's own parameters are those no earlier unit took
            owned[unit.name] = owned_params(model, unit, taken)
            taken.update(owned[unit.name])
        names = [name for name in order if name in owned]
        sizes = [sum(p.numel() for _, p in owned[name]) * param_bytes for name in names]
        unit_of = {id(p): i for i, name in enumerate(names) for _, p in owned[name]}
        return cls(sizes=tuple(sizes), shards=tuple(-(-n // world_size) for n in sizes),
                   trained=tuple(sum(p.requires_grad for _, p in owned[name]) for name in names), unit_of=unit_of,
                   kept=kept)

    @property
    def most(self) -> int:
        """FSDP2's buffers at their most (`rank.gathered_bytes`): where a unit reduces in backward (reverse forward
        order), it and the next one gathered, its gradient, a reduce-scatter input (the last unit's or its own, the
        larger), and the reduced shards of the last `REDUCED_IN_FLIGHT` + 2 units to reduce, its own among them."""
        backward, shards = self.sizes[::-1], self.shards[::-1]
        held = REDUCED_IN_FLIGHT + 2

        def reducing(j: int) -> int:
            if self.kept:  # every unit not yet reduced, this one among them
                gathered = sum(backward[j:])
            else:
                gathered = backward[j] + (backward[j + 1] if j + 1 < len(backward) else 0)
            gradients = backward[j] + max(backward[j - 1] if j else 0, backward[j])
            return gathered + gradients + sum(shards[max(0, j + 1 - held) : j + 1])

        return max((reducing(j) for j in range(len(backward))), default=0)

    @property
    def forward_most(self) -> int:
        """In forward: a unit and the next one gathered, at their most; kept, all of them (the forward's end)."""
        if self.kept:
            return sum(self.sizes)
        return max((a + b for a, b in zip(self.sizes, (*self.sizes[1:], 0), strict=True)), default=0)


class Fsdp2Buffers:
    """FSDP2's bytes now, moved by the trace's backward: `grad_arrived` as each parameter's gradient is accumulated.
    Backward runs the units in reverse forward order; a unit has started once a gradient of it arrived and reduces
    once all of its parameters' have (a unit with none does not reduce)."""

    def __init__(self, units: UnitBuffers) -> None:
        self.units = units
        self._in_backward = False
        self._now: int | None = None  # `now()` as of the last change: the trace asks at every allocation
        self._arrived = [0] * len(units.sizes)  # gradients of each unit that arrived
        self._held = [0] * len(units.sizes)  # bytes of each unit's unsharded gradient, until it reduces
        self._reduced = [False] * len(units.sizes)
        self._scatter_input = 0  # the last reduced unit's reduce-scatter input, kept until the next one reduces
        self._shards: deque[int] = deque(maxlen=REDUCED_IN_FLIGHT + 2)  # reduced shards whose copy may be pending

    @property
    def in_backward(self) -> bool:
        return self._in_backward

    @in_backward.setter
    def in_backward(self, value: bool) -> None:
        self._in_backward, self._now = value, None

    def now(self) -> int:
        if self._now is None:
            self._now = (self._gathered() + sum(self._held) + self._scatter_input + sum(self._shards)
                         if self._in_backward else self.units.forward_most)
        return self._now

    def grad_arrived(self, unit: int, nbytes: int) -> int:
        """A gradient of `nbytes` of `unit` was accumulated (the trace frees it: FSDP2 keeps it in the unit's
        unsharded gradient); FSDP2's most during this event: at the unit's reduce, where this was its last, the
        reduce-scatter input and this rank's shard come while the gradient is still held (the last unit's input
        went first), as `rank.gathered_bytes` counts a reduce."""
        self._arrived[unit] += 1
        self._held[unit] += nbytes
        self._now = None
        if self._arrived[unit] < self.units.trained[unit]:
            return self.now()
        self._scatter_input = 0
        self._shards.append(self.units.shards[unit])  # the oldest shard's copy is done: the landing waits for it
        peak = self.now() + self.units.sizes[unit]
        self._scatter_input, self._held[unit] = self.units.sizes[unit], 0
        self._reduced[unit] = True
        self._now = None
        return peak

    def _gathered(self) -> int:
        """The unit backward is in (the last in forward order not yet reduced), the next one (prefetched), and any
        other whose gradients began to arrive (its parameters stay gathered until it reduces); kept, every unit not
        yet reduced (a unit without gradients, never reduced, until backward ends)."""
        if self.units.kept:
            return sum(size for size, reduced in zip(self.units.sizes, self._reduced, strict=True) if not reduced)
        waiting = [i for i in reversed(range(len(self.units.sizes))) if not self._reduced[i] and self.units.trained[i]]
        gathered = set(waiting[:2]) | {i for i in waiting if self._arrived[i]}
        return sum(self.units.sizes[i] for i in gathered)
