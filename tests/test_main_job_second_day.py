"""scripts/train.py on a user's second day: a finished run trained further, `ckpt_path=last` among other models' runs,
a checkpoint that cannot load, a bad strategy value, the sample as a file.

Two runs train (a first run of 2 steps and its resume to 5); they and every refusal run the command in a fork of this
test process (`run_forked`), which has the script's imports loaded already: a refusal costs a second, not a new
interpreter's 10 s of importing Lightning on 2 cores.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from helpers.forked_script import run_forked
from lightning_zoff.app import resume
from lightning_zoff.app.report import readable
from lightning_zoff.checkpoint import files as checkpoint_files
from test_main_job import SMALL, TRAIN, load_weights, train
from train_overrides import CONF

# no validation (its batches would only cost time), a loss logged every step
RUN = [*SMALL, "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1"]
PROMPT = "\x01def "  # the first run's sample begins with a control byte


def run_refused(cwd: Path, *args: str, script: Path = TRAIN) -> subprocess.CompletedProcess:
    """`python scripts/train.py *args` (or `script`) in `cwd`, run in a fork of this process (`run_forked`)."""
    return run_forked(script, *args, cwd=cwd, timeout=120)


def run_dirs(cwd: Path) -> set[Path]:
    return set(cwd.glob("outputs/*/*"))


def assert_refused(cwd: Path, *args: str, script: Path = TRAIN) -> str:
    """The one line a refused run prints; it exits 2 before any rank starts and leaves no directory."""
    before = run_dirs(cwd)
    refused = run_refused(cwd, *args, script=script)
    assert refused.returncode == 2, (refused.returncode, refused.stdout[-2000:], refused.stderr[-3000:])
    assert refused.stdout == ""
    assert "Initializing distributed" not in refused.stderr  # no rank started
    [line] = refused.stderr.splitlines()  # and no traceback, no log line before it
    assert line.startswith("error: ")
    assert run_dirs(cwd) == before
    return line


@dataclass
class Runs:
    cwd: Path
    first: str  # stdout of 2 steps
    then: str  # stdout of the same run resumed with trainer.max_steps=5
    then_log: str  # its stderr


def printed_path(out: str, label: str) -> Path:
    [path] = re.findall(rf"^{label}: (/\S+)$", out, flags=re.MULTILINE)
    return Path(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    cwd = tmp_path_factory.mktemp("second_day")
    first = train(cwd, "trainer.max_steps=2", f"sample.prompt='{PROMPT}'", *RUN, fork=True).stdout
    then = train(cwd, "trainer.max_steps=5", "ckpt_path=last", *RUN, fork=True)
    return Runs(cwd, first, then.stdout, then.stderr)


def losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "lightning_logs" / "version_0" / "metrics.csv") as rows:
        return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(rows) if row["train_loss"]}


@pytest.mark.slow
def test_a_finished_run_resumed_with_more_steps_trains_on(runs):
    first = printed_path(runs.first, "checkpoint")
    checkpoint = printed_path(runs.then, "checkpoint")
    assert f"Restoring states from the checkpoint path at {first}" in runs.then_log
    assert load_weights(first)[0] == 2
    assert load_weights(checkpoint)[0] == 5
    # steps 3 to 5 trained (Lightning logs a step's loss at the step before it), from the first run's weights (below
    # its first loss, the initial model's), and the history goes on from step 2
    resumed = losses(checkpoint.parents[1])
    assert sorted(resumed) == [2, 3, 4]
    assert max(resumed.values()) < losses(first.parents[1])[0]
    history = checkpoint_files.read(checkpoint, None)["callbacks"]["LossHistory"]
    assert [step for step, _ in history["train"]] == [1, 2, 3, 4, 5]
    # the breakdown and the progress bar count the steps of this run: the bar ends at batch 5 of 5 (its index in the
    # epoch goes on from the checkpoint's), not at 5 of 3, and titles no last epoch (-1: max_steps governs)
    assert "step breakdown (rank 0, steps 4-5, mean per step):" in runs.then
    assert re.search(r"Epoch 1(: 100%\|\S*\|| +\S+) 5/5 ", runs.then), runs.then[-1500:]
    assert "/-" not in runs.then.replace(runs.then.split(" sample ")[1], "")
    # every path printed exists
    for out in (runs.first, runs.then):
        for label in ("checkpoint", "loss curve", "sample"):
            assert printed_path(out, label).exists(), label


@pytest.mark.slow
def test_the_sample_is_saved_beside_the_loss_curve_with_control_bytes_escaped(runs):
    sample_file = printed_path(runs.first, "sample")
    assert sample_file == printed_path(runs.first, "loss curve").with_name("sample.txt")
    text = sample_file.read_text()
    assert text.startswith("\\x01def ")  # the prompt's byte 1, escaped
    assert all(char.isprintable() or char in "\n\t" for char in text)
    printed = runs.first.split(" sample ")[1].split("\n", 1)[1]
    assert printed.startswith(text.rstrip("\n"))
    # how bytes read: UTF-8 kept, newline and tab kept, control bytes and bytes that are not UTF-8 as \xNN
    assert readable(b"a\x00\x01\tb\n\x7f\xff\xe2\x82\xac\r") == "a\\x00\\x01\tb\n\\x7f\\xff\u20ac\\x0d"


def job(outputs: Path, time_dir: str, *overrides: str, checkpoint_of: Path | None = None) -> Path:
    """checkpoints/last.ckpt of a job of `overrides` in outputs/2000-01-01/<time_dir>, as Hydra records a job: its
    composed configuration and its options in .hydra/. The checkpoint is a copy of `checkpoint_of`'s, or an empty
    directory: `last` is found by the configuration."""
    run_dir = outputs / "2000-01-01" / time_dir
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    (run_dir / ".hydra").mkdir(parents=True)
    choices = {"hydra": {"runtime": {"choices": dict(cfg.hydra.runtime.choices)}}}
    OmegaConf.save(choices, run_dir / ".hydra" / "hydra.yaml")
    OmegaConf.save({key: cfg[key] for key in cfg if key != "hydra"}, run_dir / ".hydra" / "config.yaml")
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    if checkpoint_of is None:
        checkpoint.mkdir(parents=True)
    else:
        shutil.copytree(checkpoint_of, checkpoint)
    return checkpoint


def model_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides)).model


def test_last_is_the_newest_checkpoint_of_this_model(tmp_path):
    outputs = tmp_path / "outputs"
    older, newer = job(outputs, "12-00-00"), job(outputs, "09-00-00")
    jobs = [older, newer, job(outputs, "10-00-00", "model=hf_llama_tiny_lora"),
            job(outputs, "11-00-00", "model.n_layer=2")]
    for i, path in enumerate(jobs):
        os.utime(path, (i, i))  # the later modified, the newer (the directories' names sort otherwise)
    assert resume.find_checkpoint("last", outputs, model_config(), "gpt_tiny") == newer
    assert resume.find_checkpoint("last", outputs, model_config("model.n_layer=2"), "gpt_tiny") == jobs[3]
    with pytest.raises(ValueError, match=re.escape(
            f"ckpt_path=last: the newest {jobs[3]} is of model gpt_tiny with n_layer=2, not n_layer=3, and no other")):
        resume.find_checkpoint("last", outputs, model_config("model.n_layer=3"), "gpt_tiny")
    assert resume.find_checkpoint(str(older), outputs, model_config(), "gpt_tiny") == older  # a path: as it is
    with pytest.raises(ValueError, match=r"ckpt_path=last: no checkpoints/last\.ckpt under .*elsewhere"):
        resume.find_checkpoint("last", tmp_path / "elsewhere", model_config(), "gpt_tiny")
    with pytest.raises(ValueError, match=r"ckpt_path=nothing/here: no such file or directory"):
        resume.find_checkpoint("nothing/here", outputs, model_config(), "gpt_tiny")


def test_last_finds_a_job_that_recorded_a_removed_option(tmp_path):
    # a job from before update_lag was removed recorded it (`strategy.update_lag: 1`); its checkpoint's meta.pt does
    # not (nothing of the strategy's options), so the checkpoint resumes as any other
    outputs = tmp_path / "outputs"
    checkpoint = job(outputs, "12-00-00")
    recorded = checkpoint.parents[1] / ".hydra" / "config.yaml"
    config = OmegaConf.load(recorded)
    config.strategy.update_lag = 1
    OmegaConf.save(config, recorded)
    assert resume.find_checkpoint("last", outputs, model_config(), "gpt_tiny") == checkpoint


@pytest.mark.slow
def test_last_takes_this_models_newest_and_a_run_with_nothing_to_train_says_so(runs):
    then = printed_path(runs.then, "checkpoint")
    newer = job(runs.cwd / "outputs", "23-59-59", "model=hf_llama_tiny_lora", checkpoint_of=then)
    os.utime(newer, (time.time() + 60, time.time() + 60))
    try:
        line = assert_refused(runs.cwd, "trainer.max_steps=5", "ckpt_path=last", *RUN)
    finally:
        shutil.rmtree(newer.parents[2])
    assert line == (f"error: ckpt_path=last ({then.relative_to(runs.cwd)}): the checkpoint is at step 5 and"
                    " trainer.max_steps=5: nothing to train; raise trainer.max_steps above 5")


@pytest.mark.slow
def test_last_of_another_model_is_refused(runs, tmp_path):
    first = printed_path(runs.first, "checkpoint")
    other = job(tmp_path / "outputs", "00-00-00", "model=hf_llama_tiny_lora", checkpoint_of=first)
    line = assert_refused(tmp_path, "trainer.max_steps=5", "ckpt_path=last", *RUN)
    assert line == (f"error: ckpt_path=last: the newest {other.relative_to(tmp_path)} is of model hf_llama_tiny_lora,"
                    " not gpt_tiny, and no other under outputs is of this model; give the model options it was trained"
                    " with, or name a checkpoint: ckpt_path=PATH")


@pytest.mark.slow
def test_a_truncated_checkpoint_is_refused_before_any_rank_starts(runs, tmp_path):
    truncated = tmp_path / "truncated.ckpt"
    shutil.copytree(printed_path(runs.first, "checkpoint"), truncated)
    rank_file = truncated / "rank1.safetensors"
    size = rank_file.stat().st_size
    os.truncate(rank_file, size // 2)
    line = assert_refused(runs.cwd, "trainer.max_steps=5", f"ckpt_path={truncated}", *RUN)
    assert line == (f"error: ckpt_path={truncated}: {rank_file}: truncated: {size // 2} bytes, meta.pt records"
                    f" {size}")


@pytest.mark.slow
def test_a_checkpoint_of_another_shape_is_refused_before_any_rank_starts(runs):
    checkpoint = printed_path(runs.first, "checkpoint")
    line = assert_refused(runs.cwd, "trainer.max_steps=5", "model.n_layer=3", f"ckpt_path={checkpoint}", *RUN)
    assert line.startswith(f"error: ckpt_path={checkpoint}: {checkpoint / 'meta.pt'}: written for another model:"
                           " missing [], unexpected ['model.blocks.3.")


@pytest.mark.parametrize(("value", "message"), [
    ("strategy.accelerator_state=2.5", "strategy.accelerator_state=2.5; choose 'auto', 'none' or a fraction"),
    ("strategy.offload=maybe", "strategy.offload='maybe': expected true or false."),
])
def test_a_bad_strategy_value_is_one_line_naming_its_key(tmp_path, value, message):
    line = assert_refused(tmp_path, value)
    assert line.startswith(f"error: {message}")
    assert not (tmp_path / "outputs").exists()


def test_a_model_the_machine_cannot_hold_is_refused_by_the_plan_in_one_line(tmp_path, monkeypatch):
    """The plan refuses in the ranks, at setup, before anything is sharded: the job prints the plan's line (its
    numbers and the options that would fit) as its error, no traceback, exits 2 and leaves no job directory."""
    monkeypatch.setenv("ZOFF_HOST_MEMORY_BYTES", str(10**6))  # the plan's host: 1 MB
    refused = run_refused(tmp_path, "trainer.max_steps=1", *RUN)
    assert refused.returncode == 2, (refused.returncode, refused.stderr[-3000:])
    assert "Traceback" not in refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [refused.stderr.splitlines()[-1]]
    assert errors[0].startswith("error: zoff: the optimizer state of ")
    assert "does not fit the host" in errors[0]
    assert not (tmp_path / "outputs").exists()
