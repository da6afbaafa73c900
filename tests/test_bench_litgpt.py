"""scripts/bench/bench_litgpt_scripts.py on the CPU: LitGPT's own `finetune/full.py` and `finetune/lora.py` on a small
LitGPT config with random weights and the instruction set made here, under zoff and under LitGPT's own choice of
strategy, each in a fresh process, every run's outcome and LitGPT's own iteration times in the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "bench_litgpt_scripts.py"


@pytest.mark.slow
@pytest.mark.parametrize(("script", "strategies"), [("full", ["zoff", "litgpt"]), ("lora", ["zoff"])])
def test_litgpts_finetune_scripts_under_zoff_and_litgpts_choice(tmp_path, script, strategies):
    out = tmp_path / "litgpt.json"
    command = [sys.executable, str(SCRIPT), "--model", "pythia-14m", "--script", script, "--seq", "64", "--iters", "4",
               "--warmup", "1", "--strategies", *strategies, "--work", str(tmp_path / "work"), "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    runs = json.loads(out.read_text())["runs"]
    assert [run["strategy"] for run in runs] == strategies
    for run in runs:
        assert run["outcome"] == "time", run.get("error")
        assert (run["script"], run["model"], run["seq"], run["precision"]) == (script, "pythia-14m", 64, "32-true")
        assert run["params"] == 14_067_712  # pythia-14m's
        assert len(run["iter_s"]) == len(run["losses"]) == 4
        assert run["losses"][-1] < run["losses"][0]  # it trains
        assert run["s_per_iter"] > 0
        assert run["host_tree_peak_gb"] > 0
