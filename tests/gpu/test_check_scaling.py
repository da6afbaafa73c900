"""zoff on 2 GPUs follows zoff on 1 GPU with the same global batch, each rank holding half the host state."""

from __future__ import annotations

import pytest
import torch

from zoffbench.checks import scaling

DEVICES = 2
# Only the reduction differs (bf16 gradients summed over 2 ranks instead of one batch's): at most 0.25% over 20 steps
# on the H200 x2 machine (bench/results/2026-11-29_h200x2_scaling_check.json).
MAX_REL_DIFF = 0.01


@pytest.mark.skipif(torch.cuda.device_count() < DEVICES, reason=f"needs {DEVICES} GPUs (the H200 x2 machine or larger)")
def test_two_gpus_follow_one_with_the_same_global_batch():
    summary = scaling.compare(devices=DEVICES, steps=20)
    ranks, one = summary["ranks"], summary["one_device"]
    assert len(ranks) == DEVICES
    assert all(rank["device"].startswith("cuda") for rank in ranks)
    assert summary["max_rel_diff"] < MAX_REL_DIFF, [round(d, 4) for d in summary["rel_diff"]]
    # FSDP2 splits each parameter by rows: the ranks' shards add up to the whole, half each
    assert sum(rank["memory"]["local_params"] for rank in ranks) == one["memory"]["local_params"]
    for rank in ranks:
        assert rank["memory"]["host_master"] == pytest.approx(one["memory"]["host_master"] / DEVICES, rel=0.01)
        assert rank["memory"]["host_optimizer_state"] == pytest.approx(
            one["memory"]["host_optimizer_state"] / DEVICES, rel=0.01)
