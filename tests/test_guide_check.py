"""scripts/check_guide.py, without the guide's slow commands: which of docs/guide.md's commands it runs and which it
skips and why (the skip markers in the guide), how it reads a block, and how it runs a command (ok, a failure with
its exit status and output, a timeout that ends the command's every process) on a fresh clone of HEAD.

The guide's commands themselves take minutes on 2 cores: `python scripts/check_guide.py` runs them."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

import check_guide
from check_guide import Command, commands, run
from test_guide import LITGPT_INSTALL, blocks

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "guide.md").read_text()
GPU = "needs a GPU"
KILLED = "a run killed midway: tests/test_main_job_resume.py kills one and resumes it"


def as_typed(command: Command) -> str:
    """The command's words without its comment, continuation lines joined, one space apart (quotes taken off)."""
    return " ".join(shlex.split(command.text.replace("\\\n", " "), comments=True))


def test_it_runs_the_guide_s_cpu_commands_in_order_and_skips_the_others_with_the_guide_s_reasons():
    found = commands(GUIDE)
    assert {as_typed(command): command.skip for command in found if command.skip} == {
        "python scripts/train.py optimizer=lion model=gpt_125m data=synthetic strategy.grad_accum_on=accelerator": GPU,
        "python scripts/train.py experiment=bench trainer.accumulate_grad_batches=4": GPU,
        "python scripts/train.py model=hf_qwen3_4b data=synthetic trainer.max_steps=20": GPU,
        "python scripts/train_litgpt.py --model Llama-3.2-1B --devices 1 --block-size 2048 --micro-batch 4 "
        "--strategy zoff --json zoff.json": GPU,
        "python scripts/train.py trainer.max_steps=1000": KILLED,
        "python scripts/train.py trainer.max_steps=1000 ckpt_path=last": KILLED,
        " ".join(shlex.split(LITGPT_INSTALL)): "installs a package: the checking environment is already installed",
    }
    assert (ROOT / "tests" / "test_main_job_resume.py").is_file()  # where the killed run is
    assert [as_typed(command) for command in found if not command.skip] == [
        "python scripts/train.py trainer.max_steps=3",
        "python scripts/train.py strategy=zoff_no_offload trainer.max_steps=50 optimizer.lr=1e-3",
        "python scripts/train.py optimizer=lion data=synthetic strategy.grad_accum_on=accelerator",
        "python scripts/train.py -m trainer.max_steps=2 optimizer.lr=1e-3,2e-3",
        "python scripts/train.py model=hf_qwen3_tiny trainer.max_steps=3",
        "python scripts/train.py trainer.max_steps=100",
        "python scripts/train.py trainer.max_steps=150 ckpt_path=last",  # resumes the run just before it
        "python -m lightning_zoff.cli fit --config conf/cli/gpt_tiny.yaml --trainer.max_steps=3",
        "python -m lightning_zoff.cli fit --config conf/cli/hf_qwen3_tiny.yaml --trainer.max_steps=3",
        "python scripts/train_litgpt.py --model pythia-14m --max-steps 20",
        "python scripts/train.py model=hf_llama_tiny_lora trainer.max_steps=50",
    ]
    guide_lines = GUIDE.splitlines()
    assert all(command.text.startswith(guide_lines[command.line - 1]) for command in found)  # where each starts


def test_it_reads_the_commands_that_the_guide_s_parse_check_reads():
    parsed = [shlex.split(line, comments=True) for name, body in blocks("bash") if name == "guide.md"
              for line in body.replace("\\\n", " ").splitlines()]
    assert [shlex.split(command.text.replace("\\\n", " "), comments=True) for command in commands(GUIDE)] == [
        words for words in parsed if words]


def test_a_marker_skips_the_block_under_it_only_and_continued_lines_are_one_command():
    guide = "\n".join([
        "text", "<!-- guide-check: skip (needs a GPU) -->", "```bash", "# a comment line", "gpu-run --big",
        "```", "", "```bash", "cpu-run \\", "    --small   # two lines", "", "cpu-again", "```", "```python",
        "print('not a shell command')", "```",
    ])
    assert commands(guide) == [
        Command(5, "gpu-run --big", "needs a GPU"),
        Command(9, "cpu-run \\\n    --small   # two lines"),
        Command(12, "cpu-again"),
    ]


@pytest.mark.parametrize("marker", [
    "<!-- guide-check: skip -->",  # no reason
    "<!-- guide-check: skp (needs a GPU) -->",
])
def test_a_misspelt_marker_is_refused(marker):
    with pytest.raises(ValueError, match="guide-check: skip \\(why\\)"):
        commands(f"{marker}\n```bash\nrun\n```\n")


def test_a_marker_above_anything_but_a_bash_block_is_refused():
    with pytest.raises(ValueError, match=":1: a skip marker"):
        commands("<!-- guide-check: skip (needs a GPU) -->\n```python\nrun()\n```\n")
    with pytest.raises(ValueError, match=":1: a skip marker"):
        commands("<!-- guide-check: skip (needs a GPU) -->\n\n```bash\nrun\n```\n")


def test_a_command_passes_fails_with_its_output_or_times_out(tmp_path):
    env = dict(os.environ)
    (tmp_path / "marker").touch()
    ok = run(Command(3, "test -f marker"), tmp_path, env, 10, tmp_path / "ok.log")
    assert (ok.status, ok.reason) == ("ok", None)  # it ran in the directory given
    failed = run(Command(4, "echo one; echo two >&2; exit 3"), tmp_path, env, 10, tmp_path / "failed.log")
    assert (failed.status, failed.reason, failed.output_tail) == ("failed", "exit status 3", "one\ntwo")
    skipped = run(Command(5, "exit 1", "needs a GPU"), tmp_path, env, 10, tmp_path / "skipped.log")
    assert (skipped.status, skipped.reason, skipped.seconds) == ("skipped", "needs a GPU", None)

    start = time.monotonic()
    slow = run(Command(6, "sleep 60 & echo $! > child.pid; sleep 60"), tmp_path, env, 0.5, tmp_path / "slow.log")
    assert (slow.status, slow.reason) == ("failed", "timed out after 0.5 s")
    assert time.monotonic() - start < 10
    child = int((tmp_path / "child.pid").read_text())
    for _ in range(100):  # the background child went with the command (killed; then reaped by init)
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the command's background child {child} still runs")


@pytest.mark.slow
def test_the_commands_run_in_a_clone_of_head_with_its_own_package(tmp_path, monkeypatch, capsys):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    checks = [
        Command(1, f'test -z "$(git status --porcelain)" && test "$(git rev-parse HEAD)" = {head}'),  # HEAD, clean
        # a script run from anywhere in the clone imports the clone's package
        Command(2, "cd docs && python -c 'import lightning_zoff, os; "
                   "assert lightning_zoff.__file__.startswith(os.path.dirname(os.getcwd()))'"),
        Command(3, "exit 7"),
        Command(4, "pip install something", "installs a package"),
    ]
    monkeypatch.setattr(check_guide, "commands", lambda guide: checks)
    out = tmp_path / "results.json"
    assert check_guide.main(["--out", str(out), "--timeout", "120"]) == 1  # one failure fails the check
    results = json.loads(out.read_text())
    assert [(r["line"], r["status"], r["reason"]) for r in results["results"]] == [
        (1, "ok", None), (2, "ok", None), (3, "failed", "exit status 7"), (4, "skipped", "installs a package")]
    assert (results["commit"], results["ok"], results["failed"], results["skipped"]) == (head, 2, 1, 1)
    printed = capsys.readouterr().out.splitlines()
    assert [line for line in printed if line.startswith("failed")] == [
        f"failed   {results['results'][2]['seconds']:>7.1f} s  docs/guide.md:3  exit 7  (exit status 7)"]
    assert printed[-1] == f"2 ok, 1 failed, 1 skipped in {results['total_s']:.1f} s"
