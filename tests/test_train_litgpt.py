"""scripts/train_litgpt.py as a user runs it: LitGPT's own GPT (litgpt.model.GPT, a LitGPT config) in LitGPT's
setup order under Fabric(strategy="zoff") on 2 CPU ranks (Lightning's default launcher), against the same script
under Fabric's DDP: the same losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from zoffbench.harness import free_ports

pytestmark = pytest.mark.slow  # the LitGPT script in an interpreter of its own

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "pythia-14m", "--n-layer", "2", "--block-size", "32", "--micro-batch", "2", "--accumulate", "2",
        "--max-steps", "4", "--log-every", "2", "--max-bytes", "200000", "--full-init", "--lr", "3e-3"]


def run(tmp_path: Path, strategy: str, port: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "MASTER_PORT": str(port)}
    out = tmp_path / strategy
    cmd = [sys.executable, str(ROOT / "scripts" / "train_litgpt.py"), *TINY, "--strategy", strategy,
           "--out", str(out), "--json", str(out / "run.json")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Starting with 2 processes" in proc.stdout + proc.stderr
    assert f"checkpoint: {out / (strategy + '.ckpt')}" in proc.stdout  # where it saved, said once it is there
    return json.loads((out / "run.json").read_text())


def test_litgpt_gpt_in_litgpts_setup_order_trains_as_under_ddp(tmp_path):
    # both runs at once, each on a port of its own: most of a run is its two interpreters importing Lightning and
    # LitGPT one after the other, which leaves a core idle
    with ThreadPoolExecutor(2) as pool:
        zoff, ddp = pool.map(run, [tmp_path] * 2, ["zoff", "ddp"], free_ports(2))
    assert zoff["parameters"] == ddp["parameters"]
    assert len(zoff["losses"]) == 4
    a, b = torch.tensor(zoff["losses"], dtype=torch.float64), torch.tensor(ddp["losses"], dtype=torch.float64)
    assert ((a - b).abs() / b).max() < 1e-5
    assert zoff["losses"][-1] < zoff["losses"][0] - 0.5  # it learns, so the comparison means something
    assert (tmp_path / "zoff" / "zoff.ckpt" / "meta.pt").exists()  # fabric.save: zoff's sharded checkpoint
