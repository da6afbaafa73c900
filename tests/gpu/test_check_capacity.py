"""A 6.71B GPT with bf16 moments and no overlap, all its state on the host (10 B per parameter: master 4, moments
2 x 2, the gradient's landing buffer 2, which the updated parameters leave from), built on the meta device, trains 20
steps on the 1x H200 machine's 125 GiB host (bench/results/2026-11-29_h200x1_capacity_gpt7b.json, at 12 B/param then:
loss 21.3 -> 5.29)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from zoffbench.harness import run_command

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "checks" / "check_capacity.py"
HOST_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# zoff's host state is 67 GB (6.71B x 10 B)
@pytest.mark.skipif(HOST_BYTES < 120e9, reason="needs a host of 128 GB or more (the 7B model's state is 67 GB)")
def test_gpt7b_trains_on_10_bytes_per_parameter(tmp_path):
    out = tmp_path / "capacity.json"
    run_command([sys.executable, str(SCRIPT), "--model", "gpt7b", "--steps", "20", "--batch", "4",
                 "--option", "optimizer_state_dtype='bf16'", "--option", "overlap=False",
                 "--option", "accelerator_state='none'", "--out", str(out)], output="echo").check()
    result = json.loads(out.read_text())
    assert result["params"] == 6_709_055_488
    assert result["steps"] == 20
    assert result["device"] != "cpu"
    assert result["host_bytes_per_param"] == 10.0
    assert result["loss_last_quarter"] < result["loss_first_quarter"] / 2
