"""scripts/train.py killed after a periodic checkpoint and resumed with ckpt_path= continues the run it was: the same
losses, weights and loss curve as a run that was never stopped."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_zoff.checkpoint import files as checkpoint_files
from test_main_job import ROOT, SMALL, load_weights, train

# each test starts (and stops) the main job in interpreters of their own; the runs that are not stopped, in forks of
# this process
pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
# 6 steps, last.ckpt after step 3 and at the end; a loss logged every step
RUN = ["trainer.max_steps=6", "checkpoint_every_n_steps=3", "trainer.log_every_n_steps=1", *SMALL]


def losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "lightning_logs" / "version_0" / "metrics.csv") as rows:
        return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(rows) if row["train_loss"]}


def run_dir_of(proc: subprocess.CompletedProcess) -> Path:
    return Path(proc.stdout.split("checkpoint: ")[1].split("\n")[0]).parents[1]


def assert_continues(resumed: Path, whole: Path) -> None:
    """The steps after the checkpoint: the uninterrupted run's losses (the data continues mid-epoch) and weights."""
    expected, got = losses(whole), losses(resumed)
    assert sorted(got) == [3, 4, 5]
    assert sorted(expected) == [0, 1, 2, 3, 4, 5]
    for step, loss in got.items():
        assert abs(loss - expected[step]) <= 1e-5 * abs(expected[step]), (step, loss, expected[step])
    step, weights = load_weights(resumed / "checkpoints" / "last.ckpt")
    _, weights_whole = load_weights(whole / "checkpoints" / "last.ckpt")
    assert step == 6
    assert all(torch.equal(weights[name], weights_whole[name]) for name in weights_whole)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The run never stopped."""
    return run_dir_of(train(tmp_path_factory.mktemp("whole"), *RUN, fork=True))


def killed_run(cwd: Path, *args: str) -> Path:
    """The last checkpoint of the job `args` killed (SIGKILL, its main process and ranks) right after step 3."""
    cwd.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *RUN, *args,
                           "callbacks=[{_target_:stop_job.KillAfterStep,step:3}]"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-3000:]
    [checkpoint] = (cwd / "outputs").glob("*/*/checkpoints/last.ckpt")
    assert not (checkpoint.parents[1] / "loss.png").exists()  # the job never ended
    return checkpoint


def test_a_killed_job_resumes_from_its_last_checkpoint_as_if_never_stopped(tmp_path, whole):
    checkpoint = killed_run(tmp_path)
    assert checkpoint_files.read(checkpoint, None)["global_step"] == 3  # the periodic one
    # the newest last.ckpt under outputs/: the killed job's
    resumed_proc = train(tmp_path, *RUN, "ckpt_path=last", fork=True)
    resumed = run_dir_of(resumed_proc)
    assert resumed != checkpoint.parents[1]
    assert f"Restoring states from the checkpoint path at {checkpoint}" in resumed_proc.stdout + resumed_proc.stderr
    assert_continues(resumed, whole)
    # the loss curve continues: the history came back from the checkpoint, plotted whole
    history = checkpoint_files.read(resumed / "checkpoints" / "last.ckpt", None)["callbacks"]["LossHistory"]
    assert [step for step, _ in history["train"]] == [1, 2, 3, 4, 5, 6]
    assert (resumed / "loss.png").exists()


def test_a_full_checkpoint_file_resumes_too(tmp_path, whole):
    checkpoint = killed_run(tmp_path, "strategy.state_dict_type=full")
    assert checkpoint.is_file()  # one torch.save file from rank 0
    resumed = run_dir_of(train(tmp_path, *RUN, f"ckpt_path={checkpoint}", fork=True))
    assert_continues(resumed, whole)


def test_ctrl_c_prints_the_last_checkpoint_and_the_command_that_resumes_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    # a terminal's job takes Ctrl-C; one started in the background of a script ignores SIGINT, and so would this
    # job, which inherits it: the job gets the terminal's default
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *RUN,
                           "callbacks=[{_target_:stop_job.InterruptAfterStep,step:3}]"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, start_new_session=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode != 0
    [checkpoint] = (tmp_path / "outputs").glob("*/*/checkpoints/last.ckpt")
    shown = checkpoint.relative_to(tmp_path)
    said = [line for line in proc.stderr.splitlines() if line.startswith("interrupted: ")]
    assert said == [f"interrupted: the last checkpoint is {shown} (step 3); resume it with"], proc.stderr[-3000:]
    command = proc.stderr.split(said[0] + "\n", 1)[1].splitlines()[0]
    assert command.startswith(f"  python {ROOT / 'scripts' / 'train.py'} trainer.max_steps=6 ")
    assert command.endswith(f" ckpt_path={shown}")
