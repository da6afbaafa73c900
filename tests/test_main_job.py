"""scripts/train.py as a user runs it: one job, and a sweep whose jobs each fork their own two ranks."""

from __future__ import annotations

import csv
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from helpers.forked_script import run_forked
from lightning_zoff.checkpoint import files as checkpoint_files
from lightning_zoff.checkpoint.consolidate import consolidate
from lightning_zoff.examples.gpt import GPTModule
from lightning_zoff.examples.hf import HFCausalLM

# each test starts the main job: test_one_job in an interpreter of its own, as a user does; the others in a fork of
# this process, which skips importing Lightning again
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"
# smaller than the defaults, so the runs stay short: less corpus to read, a shorter sample
SMALL = ["data.max_bytes=400000", "sample.max_new_tokens=16"]


def train(cwd: Path, *args: str, fork: bool = False) -> subprocess.CompletedProcess:
    """`python scripts/train.py *args` in `cwd`, which succeeds: in an interpreter of its own, as a user runs it, or
    with `fork` in a fork of this process (`run_forked`: the same run, without importing Lightning again)."""
    if fork:
        proc = run_forked(TRAIN, *args, cwd=cwd)
    else:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run([sys.executable, str(TRAIN), *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def load_weights(checkpoint: Path, model: pl.LightningModule | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    """The step and full fp32 weights of a sharded checkpoint directory, consolidated into one file; they load into
    `model` (default: gpt_tiny's GPTModule) strictly."""
    assert checkpoint.is_dir()  # zoff's default: sharded
    step = checkpoint_files.read(checkpoint, None)["global_step"]
    single = checkpoint.parent / "consolidated.pt"
    consolidate(checkpoint, single, progress=False)
    state_dict = torch.load(single, map_location="cpu", weights_only=True)["state_dict"]
    (model or GPTModule()).load_state_dict(state_dict)  # strict: the plain model's full weights
    return step, state_dict


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_job(tmp_path):
    proc = train(tmp_path, "trainer.max_steps=3", *SMALL)
    out = proc.stdout
    assert "Starting with 2 processes" in out + proc.stderr
    # Lightning's progress bar (on stdout): TQDM's, or Rich's where rich is installed (the hf extra brings it), titled
    # without a last epoch (max_steps ends the run)
    assert re.search(r"Epoch 0: 100%|Epoch 0 +\S+ 3/3 ", out)
    breakdown = out[out.index("step breakdown (rank 0, steps 2-3, mean per step)"):]
    for phase in ("forward", "backward", "exposed optimizer", "cpu update", "host traffic"):
        assert f"\n  {phase} " in breakdown, phase
    peaks = re.search(r"\npeak host memory \(resident\): rank 0 (\d+\.\d\d) GiB, rank 1 (\d+\.\d\d) GiB\n", out)
    assert all(0.1 < float(gib) < 4 for gib in peaks.groups())  # gpt_tiny: torch and Python, a few MB of state
    checkpoint = Path(out.split("checkpoint: ")[1].split("\n")[0])
    run_dir = checkpoint.parents[1]
    assert run_dir.parent.parent == tmp_path / "outputs"  # outputs/<date>/<time>/
    assert len(list(checkpoint.iterdir())) <= 2 + 2  # 2 ranks: a file each, and meta.pt
    step, weights = load_weights(checkpoint)
    assert step == 3
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert is_png(run_dir / "loss.png")
    sample = out.split(" sample ")[1].split("\n", 1)[1]
    assert sample.startswith("def ")
    # quiet: no line past 160 columns, no warning twice (the ranks of a node warn alike; the first speaks), the bar
    # counts epochs and steps as they are
    lines = (out + proc.stderr).splitlines()
    sampled = set(sample.splitlines())  # the sample is whatever bytes the model drew
    text = [line for line in lines if line not in sampled]
    assert max(len(line) for line in text) <= 160, max(text, key=len)
    warned = [line for line in lines if re.search(r"\w+Warning: ", line)]
    assert len(warned) == len(set(warned)), warned
    # Hydra configured logging: zoff's lines go through its handlers (console and train.log), each once
    assert len([line for line in lines if "zoff ranks 0-1: host " in line]) == 1, out[-3000:]
    assert "zoff ranks 0-1: host " in (run_dir / "train.log").read_text()
    assert re.search(r"Epoch 0(/0)? ", out)
    assert "/-" not in out.replace(sample, "")


def test_one_job_with_a_hugging_face_model(tmp_path):
    proc = train(tmp_path, "model=hf_qwen3_tiny", "trainer.max_steps=3", "trainer.log_every_n_steps=1", *SMALL,
                 fork=True)
    out = proc.stdout
    # the model summary: the transformers model, walked into (its layers, embedding, norm and head are the units)
    assert re.search(r"\bQwen3ForCausalLM\b", out)
    checkpoint = Path(out.split("checkpoint: ")[1].split("\n")[0])
    run_dir = checkpoint.parents[1]
    metrics = run_dir / "lightning_logs" / "version_0" / "metrics.csv"  # Lightning's CSVLogger: no tensorboard here
    if metrics.exists():
        with open(metrics) as rows:
            logged = list(csv.DictReader(rows))
        losses = [float(row["train_loss"]) for row in logged if row["train_loss"]]
        assert len(losses) == 3
        assert len([row for row in logged if row.get("zoff/forward_s")]) == 3  # the job adds ZoffStatsMonitor
        assert all(math.isfinite(loss) for loss in losses)
        assert losses[-1] < losses[0]
    else:  # TensorBoard's logger: the progress bar's (TQDM or Rich) last loss
        assert re.search(r"train_loss[=:] ?\d", out)
    step, weights = load_weights(checkpoint, HFCausalLM("qwen3_tiny"))
    assert step == 3
    assert "model.model.layers.1.mlp.down_proj.weight" in weights
    assert is_png(run_dir / "loss.png")
    # the sample: HFCausalLM.sample, run by the sharded model in both ranks
    sample = out.split(" sample ")[1].split("\n", 1)[1]
    assert sample.startswith("def ")
    assert "step breakdown (rank 0, steps 2-3" in out


def test_sweep_runs_each_job_in_its_own_directory(tmp_path):
    proc = train(tmp_path, "-m", "trainer.max_steps=2", "optimizer.lr=1e-3,2e-3", *SMALL, fork=True)
    jobs = sorted((tmp_path / "multirun").glob("*/*/[0-9]"))
    assert [job.name for job in jobs] == ["0", "1"], proc.stdout[-2000:]
    weights = []
    for job, lr in zip(jobs, ("0.001", "0.002"), strict=True):
        assert f"optimizer.lr={lr}" in (job / ".hydra" / "overrides.yaml").read_text()
        step, state = load_weights(job / "checkpoints" / "last.ckpt")
        assert step == 2
        assert is_png(job / "loss.png")
        weights.append(state)
    # both jobs trained from the same seed, so only the learning rate can tell their weights apart
    assert not torch.equal(weights[0]["model.blocks.0.mlp.fc.weight"], weights[1]["model.blocks.0.mlp.fc.weight"])
    assert proc.stdout.count("step breakdown (rank 0") == 2


def test_a_key_that_does_not_exist_is_named_with_the_keys_there(tmp_path):
    proc = run_forked(TRAIN, "trainer.max_step=3", cwd=tmp_path)
    assert proc.returncode == 2
    assert re.search(r"'trainer\.max_step' does not exist; trainer has: accelerator, .*, max_steps, ", proc.stderr)
    assert "+trainer.max_step" not in proc.stdout + proc.stderr  # Hydra's advice to add the key does not come first
    assert not (tmp_path / "outputs").exists()  # nothing ran


def test_a_value_that_leaves_no_data_is_named_without_a_traceback(tmp_path):
    proc = run_forked(TRAIN, "data.batch_size=0", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: data.batch_size=0: expected a positive integer"
    assert "Traceback" not in proc.stdout + proc.stderr
