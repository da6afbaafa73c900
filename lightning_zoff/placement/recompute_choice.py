"""How many blocks "auto" recomputes, once the traced step says some must: all of them where the accelerator cannot
hold every unit's optimizer state beside the step even then (its memory is worth more as state: the host's update,
not the accelerator, sets the pace), else only as many as the step needs for all the state to fit beside it. Those
are the first blocks in forward order (as `activation_checkpointing_policy=N` takes them): each recomputed block costs
a second forward of it, and the peak at the end of the forward holds every block's activations alike.

The traced step's bytes fall about linearly with the blocks recomputed, so a guess from the two ends (none, all) is
checked by tracing the step at it, and walked up or down a block at a time while the checks say so.

Where a block's recompute costs a step more than the host's update of the optimizer state its activations displace
(`step_costs.py`: many micro-batches a step), "auto" instead recomputes the fewest blocks with which the plan fits at
all, the host holding the state the accelerator then cannot (found by halving: `fewest_that_fit`). `RankMemory` asks
(`rank.py`), traces, and says what it chose.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from torch import nn

from lightning_zoff._compat import set_recompute
from lightning_zoff.placement.plan import MemoryPlan, Placement, StepMemory
from lightning_zoff.placement.policy import accelerator_holds_all
from lightning_zoff.placement.refusal import PlanDoesNotFit


def fewest_blocks(count: int, fits: Callable[[int], bool], guess: int) -> int:
    """The fewest of `count` blocks to recompute for which `fits` holds, `fits` rising with the number (and true at
    `count`), starting the walk at `guess`."""
    n = min(max(guess, 1), count)
    if fits(n):
        while n > 1 and fits(n - 1):
            n -= 1
        return n
    n += 1
    while n < count and not fits(n):
        n += 1
    return n


def fewest_by_halves(low: int, high: int, fits: Callable[[int], bool]) -> int:
    """The fewest blocks in (`low`, `high`] for which `fits` holds, `fits` rising with the number, false at `low` and
    true at `high`: by halving the interval (a few traces where a guess from the ends has no line to follow)."""
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return high


def linear_guess(count: int, kept: int, all_recomputed: int, room: int) -> int:
    """Blocks to recompute for a step of `kept` bytes with none recomputed and `all_recomputed` with all `count` to
    fall within `room`, each block saving the same share."""
    saving = (kept - all_recomputed) / count
    if saving <= 0:
        return count
    return max(1, min(count, math.ceil((kept - room) / saving)))


def fewer_for_all_state(blocks: Sequence[nn.Module], kept: StepMemory, recomputed: StepMemory,
                        trace: Callable[[], StepMemory | None], plan_with: Callable[[StepMemory], MemoryPlan]
                        ) -> tuple[int, StepMemory] | None:
    """Where the accelerator can hold all the state beside the step with every block recomputed, the fewest first
    `blocks` that let it (a guess from the ends, walked), switched on and the rest off, with their step; else None
    (all stay on)."""
    plan = plan_with(recomputed)
    if not accelerator_holds_all(plan) or len(blocks) < 2:
        return None
    capacity = plan.machine.accelerator_capacity or 0
    room = capacity - (plan.with_placement({s.name: Placement.ACCELERATOR for s in plan.shapes}).accelerator_need
                       - recomputed.total)
    traced: dict[int, StepMemory | None] = {len(blocks): recomputed}
    fits = _traced_check(blocks, trace, traced, lambda step: accelerator_holds_all(plan_with(step)))
    guess = linear_guess(len(blocks), kept.total, recomputed.total, room)
    count = fewest_blocks(len(blocks), fits, guess)
    switch_first(blocks, count)
    chosen = traced.get(count)
    return None if chosen is None or count == len(blocks) else (count, chosen)


def fewest_that_fit(blocks: Sequence[nn.Module], most: int, kept: StepMemory | None,
                    trace: Callable[[], StepMemory | None], plan_with: Callable[[StepMemory], MemoryPlan]
                    ) -> tuple[int, StepMemory] | None:
    """The fewest first `blocks` recomputed with which the plan fits at all (none where `kept`, the step with none,
    fits), switched on and the rest off, with their step; None where that is `most` (the first `most` stay on)."""
    traced: dict[int, StepMemory | None] = {0: kept}
    fits = _traced_check(blocks, trace, traced, lambda step: plan_with(step) is not None)
    count = 0 if kept is not None else fewest_by_halves(0, most, fits)
    chosen = traced.get(count)
    if chosen is None or count >= most:
        switch_first(blocks, most)
        return None
    switch_first(blocks, count)
    return count, chosen


def switch_first(blocks: Sequence[nn.Module], count: int) -> None:
    """Recompute the first `count` of `blocks`' activations, not the others'."""
    for i, block in enumerate(blocks):
        set_recompute(block, i < count)


def _traced_check(blocks: Sequence[nn.Module], trace: Callable[[], StepMemory | None],
                  traced: dict[int, StepMemory | None], accepts: Callable[[StepMemory], bool]) -> Callable[[int], bool]:
    """`fits(n)`: the first `n` blocks switched on, the step traced (kept in `traced`) and `accepts` asked of it; a
    plan that refuses, or a step that cannot be traced, does not fit."""
    def fits(n: int) -> bool:
        switch_first(blocks, n)
        traced[n] = step = trace()
        try:
            return step is not None and accepts(step)
        except PlanDoesNotFit:
            return False
    return fits
