"""What zoff prints: once per node what every rank of it would say, and nothing cutting into a progress bar."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import helpers.trainer
from helpers.tiny import token_loader
from helpers.tiny_module import TinyModule
from lightning_zoff import ZoffStrategy
from lightning_zoff.checkpoint.consolidate import consolidate

SCRIPT = Path(__file__).parent / "scripts" / "speak.py"


def speak(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_ranks_of_a_node_speak_once():
    out = speak()
    # one memory line for both ranks (they hold the same): from the first rank of the node, naming both, short
    lines = re.findall(r"zoff ranks? [\d,-]+: host .* planned .*", out)
    assert len(lines) == 1
    assert lines[0].startswith("zoff ranks 0-1: host ")
    assert lines[0].endswith("1 CPU thread(s)")
    assert len(lines[0]) < 120
    assert out.count("a step decays such a moment by less than half a bf16 ulp") == 1  # a warning every rank raises
    assert out.count("UserWarning: a warning that every rank of the node raises alike") == 1  # not zoff's: once too
    assert "(local 0 of 2)" not in out  # the CPU layout of each rank: debug


@pytest.mark.parametrize("configure", ["", "logging.basicConfig(level=logging.INFO)"], ids=["none", "basicConfig"])
def test_each_zoff_line_appears_once_whether_the_application_configured_logging_or_not(configure):
    # zoff's own handler prints only while the application has configured none; after that the root's handlers do
    app = f"import logging, lightning_zoff\n{configure}\nlogging.getLogger('lightning_zoff').info('a zoff line')"
    proc = subprocess.run([sys.executable, "-c", app], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout + proc.stderr).count("a zoff line") == 1, proc.stderr


@pytest.mark.slow
def test_each_rank_says_its_own_cpu_layout_at_debug_level():
    out = speak("debug")
    for rank in (0, 1):
        line = re.search(rf"zoff rank {rank} \(local {rank} of 2\): cores .*", out)[0]
        assert "not bound to these cores: the model trains on the CPU" in line, line


def test_consolidate_shows_only_its_progress(tmp_path, capsys):
    pl.seed_everything(1)
    helpers.trainer.fit(TinyModule(), token_loader(n=8), ZoffStrategy(start_method="fork"), max_steps=1,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)],
                        enable_checkpointing=True)
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        consolidate(tmp_path / "last.ckpt", tmp_path / "one.pt", progress=True)
    assert [str(w.message) for w in caught] == []  # torch's "torch.distributed is disabled ..." among them before
    assert "consolidate" in capsys.readouterr().err  # the bar
    assert torch.load(tmp_path / "one.pt", weights_only=True)["state_dict"].keys() == TinyModule().state_dict().keys()
