"""lightning_zoff.cli with the YAML files in conf/cli/: the strategy by name (run as a user runs it) and as a class."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import seed_everything

from lightning_zoff import ZoffStrategy
from lightning_zoff.cli import main
from lightning_zoff.examples.corpus import CorpusDataModule
from lightning_zoff.examples.gpt import GPTModule
from lightning_zoff.examples.hf import HFCausalLM

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "conf" / "cli"


@pytest.mark.slow
def test_fit_from_yaml_with_the_strategy_name(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # Lightning starts rank 1 by re-running this command: every rank reads the same files
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_zoff.cli", "fit", "--config", str(CLI / "gpt_tiny.yaml"),
         "--trainer.max_steps=3"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    # both ranks set up the offload engine; the first rank of the node reports for both, once: the memory, what it
    # keeps for the rest of the process tree and where the optimizer state is
    assert out.count("zoff ranks 0-1: host ") == 1
    assert out.count("zoff ranks 0-1: host: ") == 1
    assert out.count("zoff ranks 0-1: state: ") == 1
    assert out.count("zoff ranks 0-1:") == 3
    assert "zoff rank 1" not in out
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in out
    # the main job's progress bar and quiet output: no last epoch of -1 (max_steps governs), no tips, no deprecation
    # warnings of the libraries in any rank
    assert re.search(r"Epoch 0[: ]", proc.stdout)
    assert "Epoch 0/-" not in out
    assert "💡 Tip" not in out
    assert "LeafSpec" not in out
    config = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "config.yaml").read_text())
    assert config["trainer"]["strategy"] == "zoff"
    assert config["trainer"]["max_steps"] == 3


@pytest.mark.slow
def test_a_model_the_machine_cannot_hold_is_refused_by_the_plan_in_one_line(tmp_path):
    """The plan refuses in every rank at setup; the command prints its line once (the rank it started again stays
    silent), no traceback, and exits 2."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "ZOFF_HOST_MEMORY_BYTES": str(10**6)}  # the plan's host: 1 MB
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_zoff.cli", "fit", "--config", str(CLI / "gpt_tiny.yaml"),
         "--trainer.max_steps=1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1
    assert errors[0].startswith("error: zoff: the optimizer state of ")
    assert "does not fit the host" in errors[0]


def test_class_path_variant_sets_the_options():
    cli = main(["--config", str(CLI / "gpt_tiny.yaml"), "--config", str(CLI / "zoff_class_path.yaml"),
                "--trainer.strategy.init_args.grad_accum_on=accelerator", "--trainer.logger=false"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ZoffStrategy)
    config = strategy.config
    assert (config.offload, config.start_method, config.grad_accum_on) == (True, "fork", "accelerator")
    assert cli.trainer.max_steps == 200
    assert cli.trainer.num_devices == 2  # the rest of gpt_tiny.yaml still holds
    assert isinstance(cli.model, GPTModule)
    assert isinstance(cli.datamodule, CorpusDataModule)
    optimizer = cli.model.configure_optimizers()
    assert type(optimizer).__name__ == "AdamW"
    assert optimizer.defaults["lr"] == 1e-3


@pytest.mark.slow
def test_hugging_face_model_from_yaml_trains(tmp_path):
    # in this process, the ranks forked (zoff_class_path.yaml): the command-line run is the GPT test's above
    cli = main(["fit", "--config", str(CLI / "hf_qwen3_tiny.yaml"), "--config", str(CLI / "zoff_class_path.yaml"),
                "--trainer.strategy.init_args.weights_to_main_process=true", "--trainer.max_steps=2",
                "--trainer.limit_val_batches=0", "--trainer.logger=false",
                "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
                f"--trainer.default_root_dir={tmp_path}", "--data.init_args.max_bytes=100000"])
    module = cli.model
    assert isinstance(module, HFCausalLM)
    assert type(module.model).__name__ == "Qwen3ForCausalLM"
    assert (module.hparams.model, module.block_size, cli.datamodule.block_size) == ("qwen3_tiny", 128, 128)
    assert cli.trainer.state.finished
    assert torch.isfinite(cli.trainer.callback_metrics["train_loss"])
    # the main process's model got the trained weights back: not the init's any more (same seed, built again)
    seed_everything(1234)
    assert not torch.equal(module.model.lm_head.weight, HFCausalLM("qwen3_tiny").model.lm_head.weight)


def test_wrong_option_type_names_the_key(capsys):
    with pytest.raises(SystemExit):
        main(["--config", str(CLI / "gpt_tiny.yaml"), "--config", str(CLI / "zoff_class_path.yaml"),
              "--trainer.strategy.init_args.offload=maybe"], run=False)
    assert capsys.readouterr().err.startswith("error: --trainer.strategy.offload=maybe: expected bool\n")


def test_without_the_cli_extra_the_hint_names_it(monkeypatch):
    import lightning_zoff.cli

    monkeypatch.setattr(lightning_zoff.cli, "_CLI_EXTRA", False)
    with pytest.raises(SystemExit, match=r"pip install 'lightning-zoff\[cli\]'"):
        lightning_zoff.cli.main(["fit", "--help"], run=False)
