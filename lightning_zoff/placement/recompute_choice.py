"""How many blocks "auto" recomputes, once the traced step says some must: all of them where the accelerator cannot
hold every unit's optimizer state beside the step even then (its memory is worth more as state: the host's update,
not the accelerator, sets the pace), else only as many as the step needs for all the state to fit beside it. Those
are the first blocks in forward order (as `activation_checkpointing_policy=N` takes them): each recomputed block costs
a second forward of it, and the peak at the end of the forward holds every block's activations alike.

The traced step's bytes fall about linearly with the blocks recomputed, so a guess from the two ends (none, all) is
checked by tracing the step at it, and walked up or down a block at a time while the checks say so.

Where a block's recompute costs a step more than the host's update of the optimizer state its activations displace
(`step_costs.py`: many micro-batches a step), "auto" instead recomputes the fewest blocks with which the plan fits at
all, the host holding the state the accelerator then cannot.
"""

from __future__ import annotations

import math
from collections.abc import Callable


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
