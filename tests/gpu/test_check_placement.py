"""Optimizer state on the GPU trains as on the host, and "auto" puts state there after the first step."""

from __future__ import annotations

import pytest

from zoffbench.checks import placement


@pytest.mark.parametrize("accumulate", [1, 2])
def test_state_on_the_gpu_trains_as_on_the_host(accumulate):
    summary = placement.compare(steps=12, accumulate=accumulate)
    assert summary["device"].startswith("cuda")
    for mode in placement.MODES:
        assert summary[mode]["max_rel_loss_diff_vs_host"] < 1e-5, (mode, summary)
    assert summary["none"]["placement"]["accelerator"][0] == 0
    assert summary["half"]["placement"]["accelerator"][0] > 0
    assert summary["half"]["placement"]["host"][0] > 0
    assert summary["all"]["placement"]["host"][0] == 0
    # a small model on a large GPU: "auto" moves every unit there after the first step
    assert summary["auto"]["placement"]["host"][0] == 0
