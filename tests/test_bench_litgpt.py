"""scripts/bench/bench_litgpt_scripts.py on the CPU: LitGPT's own `finetune/full.py` and `finetune/lora.py` on a small
LitGPT config with random weights and the instruction set made here, under zoff and under LitGPT's own choice of
strategy, each in a fresh process, every run's outcome and LitGPT's own iteration times in the JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "bench_litgpt_scripts.py"


def bench_script():
    spec = importlib.util.spec_from_file_location("bench_litgpt_scripts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its children import it by this name
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize(("script", "strategies"), [("full", ["zoff", "litgpt"]), ("lora", ["zoff"])])
def test_litgpts_finetune_scripts_under_zoff_and_litgpts_choice(tmp_path, script, strategies):
    out = tmp_path / "litgpt.json"
    bench_script().main(["--model", "pythia-14m", "--script", script, "--seq", "64", "--iters", "4", "--warmup", "1",
                         "--strategies", *strategies, "--work", str(tmp_path / "work"), "--out", str(out),
                         "--run-timeout-s", "240"])  # here; each run in a fresh process of its own
    runs = json.loads(out.read_text())["runs"]
    assert [run["strategy"] for run in runs] == strategies
    for run in runs:
        assert run["outcome"] == "time", run.get("error")
        assert (run["script"], run["model"], run["seq"], run["precision"]) == (script, "pythia-14m", 64, "32-true")
        assert run["params"] == 14_067_712  # pythia-14m's
        assert len(run["iter_s"]) == len(run["losses"]) == 4
        assert run["s_per_iter"] > 0
        assert run["host_tree_peak_gb"] > 0
        # zoff's own setup lines (where the state went), which the captured output would otherwise hide
        placed = [line for line in run["zoff_lines"] if line.startswith("zoff rank 0: state: ")]
        assert bool(placed) == (run["strategy"] == "zoff"), run["zoff_lines"]
        # what LitGPT saved at the end, read as its tools read it: full trained every tensor; LoRA (merged into the
        # frozen base) only the attention's qkv weights, which hold its query and value adapters
        base = torch.load(tmp_path / "work" / "base" / "lit_model.pth")
        final = torch.load(tmp_path / "work" / f"out_{run['strategy']}" / "final" / "lit_model.pth")
        final = final.get("model", final)
        assert final.keys() == base.keys()
        changed = {name for name in base if not torch.equal(final[name].to(base[name].dtype), base[name])}
        if script == "full":
            assert changed == set(base)
        else:
            assert changed == {name for name in base if name.endswith("attn.qkv.weight")}


@pytest.mark.slow
def test_a_failed_run_keeps_its_output_before_the_error_line(tmp_path):
    """A run that stops records its one line and the output above it: a CUDA error's cause is lines above its last."""
    out = tmp_path / "litgpt.json"
    bench_script().main(["--model", "pythia-14m", "--seq", "64", "--iters", "2", "--strategies", "zoff",
                         "--precision", "no-such-precision", "--work", str(tmp_path / "work"), "--out", str(out),
                         "--run-timeout-s", "240"])
    (run,) = json.loads(out.read_text())["runs"]
    assert run["outcome"] == "error"
    assert "no-such-precision" in run["error"]
    assert "Traceback" in run["stderr_tail"]
    assert run["error"] in run["stderr_tail"]
