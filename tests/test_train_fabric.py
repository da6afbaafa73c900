"""scripts/train_fabric.py as a user runs it: the example GPT in a plain Fabric loop, two forked CPU ranks, with the
main job's Hydra configs; its checkpoint holds the trained weights in the Trainer's layout, and a checkpoint of either
script resumed by the other goes on from its step."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.forked_script import run_forked
from lightning_zoff.checkpoint import files as checkpoint_files
from test_main_job import SMALL, load_weights, train

# the Fabric script's first run in an interpreter of its own, as a user runs it; the resumes in forks of this process
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_fabric.py"


def train_fabric(cwd: Path, *args: str, fork: bool = False) -> subprocess.CompletedProcess:
    """`python scripts/train_fabric.py *args` in `cwd`, which succeeds: in an interpreter of its own, or with `fork`
    in a fork of this process (`run_forked`)."""
    if fork:
        proc = run_forked(SCRIPT, *args, *SMALL, cwd=cwd)
    else:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run([sys.executable, str(SCRIPT), *args, *SMALL], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def logged_steps(out: str) -> list[int]:
    return [int(step) for step in re.findall(r"^step (\d+) loss \d+\.\d+ forward", out, re.MULTILINE)]


def checkpoint_of(out: str) -> Path:
    return Path(re.search(r"^checkpoint: (.*)$", out, re.MULTILINE).group(1))


@pytest.fixture(scope="module")
def fabric_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    cwd = tmp_path_factory.mktemp("fabric")
    return cwd, train_fabric(cwd, "trainer.max_steps=4", "trainer.accumulate_grad_batches=2",
                             "trainer.log_every_n_steps=2")


def test_train_fabric_runs_the_main_jobs_configs(fabric_run):
    _, proc = fabric_run
    out = proc.stdout
    assert "Starting with 2 processes" in out + proc.stderr
    line = r"^step [24] loss (\d+\.\d+) forward .*s backward .*s exposed_optimizer"
    losses = [float(loss) for loss in re.findall(line, out, re.MULTILINE)]
    assert len(losses) == 2
    assert all(0 < loss < 6 for loss in losses)  # bytes: ln 256 = 5.5 before training
    checkpoint = checkpoint_of(out)
    assert checkpoint_files.read(checkpoint, None)["global_step"] == 4
    step, _ = load_weights(checkpoint)  # consolidated; loads strictly into the plain GPTModule
    assert step == 4
    assert "-" * 40 + " sample " + "-" * 40 in out


def test_a_checkpoint_of_either_door_resumed_by_the_other_goes_on_from_its_step(fabric_run):
    cwd, proc = fabric_run
    # the Fabric loop's checkpoint (step 4) under the Trainer: steps 5 and 6, not 6 steps from 0 again
    main = train(cwd, f"ckpt_path={checkpoint_of(proc.stdout)}", "trainer.max_steps=6", "trainer.log_every_n_steps=1",
                 "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0", *SMALL, fork=True)
    trained = checkpoint_of(main.stdout)
    with open(trained.parents[1] / "lightning_logs" / "version_0" / "metrics.csv") as rows:
        assert sorted({int(row["step"]) for row in csv.DictReader(rows) if row["train_loss"]}) == [4, 5]
    assert checkpoint_files.read(trained, None)["global_step"] == 6
    # and the Trainer's checkpoint (step 6) under the Fabric loop: steps 7 and 8
    resumed = train_fabric(cwd, f"ckpt_path={trained}", "trainer.max_steps=8", "trainer.log_every_n_steps=1",
                           fork=True)
    assert f"resumed from {trained} at step 6" in resumed.stdout
    assert logged_steps(resumed.stdout) == [7, 8]
    assert checkpoint_files.read(checkpoint_of(resumed.stdout), None)["global_step"] == 8


def test_a_model_the_machine_cannot_hold_is_refused_by_the_plan_in_one_line(tmp_path, monkeypatch):
    """The ranks' plan refuses at `fabric.setup`; the Fabric launcher raises the rank's own PlanDoesNotFit in the
    main process, and the script prints its line, no traceback, exit status 2, and leaves no job directory."""
    monkeypatch.setenv("ZOFF_HOST_MEMORY_BYTES", str(10**6))  # the plan's host: 1 MB
    refused = run_forked(SCRIPT, "trainer.max_steps=1", *SMALL, cwd=tmp_path)
    assert refused.returncode == 2, (refused.returncode, refused.stderr[-3000:])
    assert "Traceback" not in refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [refused.stderr.splitlines()[-1]]
    assert errors[0].startswith("error: zoff: the optimizer state of ")
    assert not (tmp_path / "outputs").exists()
