"""The overlapped engine gives the synchronous engine's bits on the GPU: losses, step outcomes and fp32 masters."""

from __future__ import annotations

import pytest

from zoffbench.checks import overlap


@pytest.mark.parametrize("accumulate", [1, 2])
def test_overlap_equals_sync_bit_for_bit(accumulate):
    summary = overlap.compare(steps=12, accumulate=accumulate)
    assert summary["device"].startswith("cuda")
    # the run covers every decision: a skipped step (the poisoned one), clipped and unclipped steps
    assert summary["skipped_steps"] == [overlap.BAD_STEP]
    assert summary["clipped_steps"] > 0
    assert summary["unclipped_steps"] > 0
    for mode in overlap.OVERLAPPED:
        assert summary[mode]["bitwise_equal_to_sync"], (mode, summary)
    # with every speculation run before the decision, both of its outcomes happen: kept (unclipped) and redone;
    # counted before the fit's teardown (None: never read) with spare sets to speculate into
    awaited = summary["overlap_awaited"]
    assert awaited["spare_sets"] > 0
    assert awaited["speculations"] is not None
    assert awaited["speculations"]["kept"] > 0
    assert awaited["speculations"]["redone"] > 0
    # the GPU took every host update in "lent" (and the bits stayed the synchronous run's, above), none in sync
    assert summary["lent"]["lent_units"] > 0
    assert summary["sync"]["lent_units"] == 0
