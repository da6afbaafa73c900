"""A bad value on the command line of the main job (scripts/train.py, Hydra's own errors included) or the CLI
(`python -m lightning_zoff.cli`) stops in at most 3 lines on stderr that name the value and what is accepted, with exit
status 2, before anything trains: no traceback, no usage dump.

The main job's commands run in a fork of this process (`run_refused`: a second each, with the script's imports
loaded), the CLI's in this process; no rank starts.
"""

from __future__ import annotations

import re

import pytest

from lightning_zoff.cli import main as cli_main, short_parse_error
from lightning_zoff.config import removed_option
from test_cli import CLI
from test_main_job import TRAIN
from test_main_job_second_day import assert_refused, run_refused
from train_overrides import hydra_refusal


@pytest.mark.parametrize(("argv", "message"), [
    (["trainer.precision=64-true"], ("error: trainer.precision=64-true: zoff does not support precision='64-true'. "
                                    "Choose one of ('32-true', 'bf16-mixed', 'bf16-true', '16-mixed', '16-true')")),
    (["trainer.precision=bf16-mixd"], ("error: trainer.precision=bf16-mixd: expected one of zoff's '32-true', "
                                      "'bf16-mixed', 'bf16-true', '16-mixed', '16-true'")),
    (["strategy=ddp", "trainer.precision=bf16-mixd"],
     "error: trainer.precision=bf16-mixd: expected one of 64, 32, 16, 'transformer-engine', "),
    (["trainer.accumulate_grad_batches=two"], "error: trainer.accumulate_grad_batches=two: expected int"),
    (["trainer.log_every_n_steps=x"], "error: trainer.log_every_n_steps=x: expected int or null"),
    (["trainer.devices=0"], "error: trainer.devices=0: `Trainer(devices=0)` value is not a valid input"),
    # a GPU trainer (experiment=bench's) on a CPU box: the accelerator is named, not the one key the line set
    (["experiment=bench", "trainer.accumulate_grad_batches=4"],
     "error: trainer.accelerator=gpu: No supported gpu backend found!"),
    (["model.n_layer=abc"], "error: model.n_layer=abc: "),
    # Hydra's own: an option that does not exist, an override it cannot read, a sweep without -m
    (["strategy=zof"], ("error: strategy=zof: no such option; strategy has: ddp, deepspeed_zero3_offload, zoff, "
                       "zoff_no_offload")),
    (["trainer.max_steps=[1"], "error: Hydra cannot read 'trainer.max_steps=[1': "),
    (["optimizer.lr=1e-3,2e-3"], ("error: Ambiguous value for argument 'optimizer.lr=1e-3,2e-3'; 1. To use it as a "
                                 "list, use key=[value1,value2]; ")),
    (["-m", "optimizer=adamw,lionn"], "error: optimizer=lionn: no such option; optimizer has: adamw, "),
])
def test_a_bad_value_of_the_main_job_is_one_line_and_exit_status_2(tmp_path, argv, message):
    line = assert_refused(tmp_path, *argv)  # exit status 2, one line on stderr, nothing on stdout, no directory
    assert line.startswith(message), line
    assert not (tmp_path / "outputs").exists()
    assert not (tmp_path / "multirun").exists()


@pytest.mark.parametrize("argv", [["strategy.update_lag=1"], ["strategy=zoff_no_offload", "+strategy.update_lag=0"]])
def test_the_main_job_says_why_an_option_was_removed(tmp_path, argv):
    refused = run_refused(tmp_path, *argv)  # as for a key that does not exist: one line, exit status 2, no directory
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr.splitlines() == [f"'strategy.update_lag': {removed_option('update_lag')}"]
    assert not (tmp_path / "outputs").exists()


def test_the_fabric_job_has_the_main_job_s_door(tmp_path):
    line = assert_refused(tmp_path, "strategy=zof", script=TRAIN.with_name("train_fabric.py"))
    assert line.startswith("error: strategy=zof: no such option; strategy has: ")


def test_hydra_refusal_composes_every_value_of_a_sweep_and_leaves_good_commands_alone():
    assert hydra_refusal(["-m", "seed=1,2", "strategy=zoff,zzz"]).startswith("strategy=zzz: no such option")
    assert hydra_refusal(["-m", "trainer.max_steps=2", "optimizer.lr=1e-3,2e-3"]) is None
    assert hydra_refusal(["-m", "seed=range(1,3)", "strategy=glob(z*)", "~callbacks"]) is None
    assert hydra_refusal(["hydra.run.dir=/tmp/run", "trainer=cpu", "--cfg", "job"]) is None
    assert hydra_refusal(["--config-name", "other", "strategy=zof"]) is None  # another configuration: Hydra's


def cli_refusal(capsys, *args: str) -> list[str]:
    with pytest.raises(SystemExit) as stop:
        cli_main(["--config", str(CLI / "gpt_tiny.yaml"), *args, "--trainer.logger=false"], run=False)
    assert stop.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("Seed set to")]
    assert 1 <= len(err) <= 3, err
    assert err[0].startswith("error: ")
    assert "Traceback" not in "\n".join(err)
    return err


@pytest.mark.parametrize(("args", "message"), [
    (["--trainer.precision=64-true"], r"zoff does not support precision='64-true'\. Choose one of \('32-true', "),
    (["--trainer.strategy=zof"], (r"--trainer\.strategy=zof: no such strategy; zoff's: zoff, zoff_no_offload; "
                                 r"Lightning's: auto, ddp, ")),
    (["--config", str(CLI / "zoff_class_path.yaml"), "--trainer.strategy.init_args.grad_accum_on=gpu"],
     r"--trainer\.strategy\.grad_accum_on=gpu: expected one of \['host', 'accelerator'\]"),
    (["--config", str(CLI / "zoff_class_path.yaml"), "--trainer.strategy.init_args.cpu_threads=0"],
     r"ZoffStrategy\(cpu_threads=0\): expected a positive integer"),
    (["--trainer.max_stepz=3"], r"unknown option --trainer\.max_stepz=3; did you mean --trainer\.max_steps"),
    (["--trainer.max_steps=abc"], r"--trainer\.max_steps=abc: expected int"),
    (["--data.batch_size=0"], r"CorpusDataModule: batch_size=0: expected a positive integer"),
    (["--config", str(CLI / "zoff_class_path.yaml"), "--trainer.strategy.init_args.update_lag=1"],
     r"^error: --trainer\.strategy\.update_lag=1: " + re.escape(str(removed_option("update_lag"))) + "$"),
])
def test_a_bad_value_of_the_cli_is_at_most_three_lines_and_exit_status_2(capsys, args, message):
    err = cli_refusal(capsys, *args)
    assert re.search(message, err[0]), err


def test_the_cli_shortens_jsonargparse_s_messages():
    tree = """Parser key "trainer.strategy":
  Does not validate against any of the Union subtypes
  Errors:
    - Expected a <class 'str'>
    - Problem with given class_path 'lightning_zoff.ZoffStrategy':
        Parser key "offload":
          Expected a <class 'bool'>. Got value: maybe
  Given value: NestedArg(key='offload', val='maybe')"""
    assert short_parse_error(tree, []) == "--trainer.strategy.offload=maybe: expected bool"
    assert short_parse_error('Parser key "config": File does not exist: x.yaml', []) == \
        "--config: File does not exist: x.yaml"
