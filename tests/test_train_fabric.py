"""scripts/train_fabric.py as a user runs it: the example GPT in a plain Fabric loop, two forked CPU ranks, with the
main job's Hydra configs; its checkpoint holds the trained weights in the Trainer's layout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from lightning_zoff.checkpoint import files as checkpoint_files
from test_main_job import SMALL, load_weights

ROOT = Path(__file__).resolve().parents[1]


def test_train_fabric_runs_the_main_jobs_configs(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_fabric.py"), "trainer.max_steps=4",
                           "trainer.accumulate_grad_batches=2", "trainer.log_every_n_steps=2", *SMALL],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert "Starting with 2 processes" in out + proc.stderr
    line = r"^step [24] loss (\d+\.\d+) forward .*s backward .*s exposed_optimizer"
    losses = [float(loss) for loss in re.findall(line, out, re.MULTILINE)]
    assert len(losses) == 2
    assert all(0 < loss < 6 for loss in losses)  # bytes: ln 256 = 5.5 before training
    checkpoint = Path(re.search(r"^checkpoint: (.*)$", out, re.MULTILINE).group(1))
    assert checkpoint_files.read(checkpoint, None)["global_step"] == 4
    step, _ = load_weights(checkpoint)  # consolidated; loads strictly into the plain GPTModule
    assert step == 4
    assert "-" * 40 + " sample " + "-" * 40 in out
