"""The guide (docs/guide.md) and README.md as written: every command of their ```bash blocks names a script or module
that exists and whose options it parses (the main job's overrides compose as Hydra would compose them, the CLI's parse,
the scripts' argparse options parse), every ```python block compiles and every ```yaml block loads; LitGPT is
installed one way everywhere; the guide's CPU LitGPT example is one that ends in under a minute on 2 cores.

Running the guide's commands themselves is out of CI's budget (about 4 minutes on 2 cores): `python
scripts/check_guide.py` runs them as written on a fresh clone (tests/test_guide_check.py checks which it runs and
which it skips); README's quick start runs in tests/test_readme.py, the main job in tests/test_main_job*.py, the CLI in
tests/test_cli.py, the LitGPT script in tests/test_train_litgpt.py.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import yaml

from train_overrides import hydra_refusal, unknown_keys

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "guide.md"]
LITGPT_INSTALL = "pip install --no-deps 'litgpt==0.5.13'"


def blocks(language: str) -> list[tuple[str, str]]:
    """(file name, body) of every ```language block of README.md and the guide."""
    return [(path.name, body) for path in DOCS
            for body in re.findall(rf"^```{language}\n(.*?)^```$", path.read_text(), re.DOTALL | re.MULTILINE)]


def commands() -> list[list[str]]:
    """The words of every command in the ```bash blocks, continuation lines joined, comments left out."""
    found = []
    for _, body in blocks("bash"):
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(words)
    return found


def script(name: str):
    spec = importlib.util.spec_from_file_location(Path(name).stem, ROOT / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_command_names_a_script_or_module_that_exists():
    for words in commands():
        if words[0] == "pip":
            continue
        assert words[0] == "python", words
        if words[1] == "-m":
            assert importlib.util.find_spec(words[2]) is not None, words
        else:
            assert (ROOT / words[1]).is_file(), words


@pytest.mark.slow
def test_the_main_job_s_commands_compose():
    for words in commands():
        if words[:2] == ["python", "scripts/train.py"]:
            assert unknown_keys(words[2:]) == [], words
            assert hydra_refusal(words[2:]) is None, words


def test_the_litgpt_script_s_commands_parse():
    pytest.importorskip("litgpt", reason=f"LitGPT: {LITGPT_INSTALL}")
    options = script("scripts/train_litgpt.py").options
    runs = [words[2:] for words in commands() if words[:2] == ["python", "scripts/train_litgpt.py"]]
    assert runs
    for argv in runs:
        options(argv)  # argparse exits on an option it does not know


def test_the_cli_s_commands_parse(monkeypatch):
    from lightning_zoff.cli import ZoffCLI, main

    monkeypatch.chdir(ROOT)  # the commands name conf/cli/ from the checkout's root
    parsed = []
    monkeypatch.setattr(ZoffCLI, "instantiate_classes", lambda self: parsed.append(self.config))  # parse, build none
    runs = [words[3:] for words in commands() if words[:3] == ["python", "-m", "lightning_zoff.cli"]]
    assert runs
    for argv in runs:
        assert argv[0] == "fit"
        main(argv[1:], run=False)  # run=False: the arguments of one subcommand, without its name
    assert len(parsed) == len(runs)


def test_python_blocks_compile_and_yaml_blocks_load():
    for name, body in blocks("python"):
        compile(body, name, "exec")
    for _, body in blocks("yaml"):
        yaml.safe_load(body)


def test_the_guide_s_cpu_litgpt_example_ends_in_under_a_minute_on_two_cores():
    guide = (ROOT / "docs" / "guide.md").read_text()
    [line] = [line for line in guide.splitlines() if "scripts/train_litgpt.py" in line and "2 CPU ranks" in line]
    assert "--model pythia-14m" in line  # pythia-160m takes about 25 s a step on 2 cores
    seconds = int(re.search(r"about (\d+) s\b", line).group(1))
    assert seconds < 60


def installs_of_litgpt() -> set[str]:
    """Every pip command that installs LitGPT in the docs, the scripts, the tests, pyproject.toml and CI, as a user
    would type it (`python -m pip install -q` as `pip install`)."""
    files = [*DOCS, ROOT / "pyproject.toml", ROOT / ".ci" / "run", *(ROOT / "scripts").rglob("*.py"),
             *(ROOT / "tests").glob("*.py"), *(ROOT / "docs").glob("*.md")]
    found = set()
    for path in files:
        if path == Path(__file__):
            continue
        text = " ".join(path.read_text().split())  # a command broken across lines of a paragraph joined
        text = text.replace("python -m pip install -q ", "pip install ")
        found.update(re.findall(r"pip install (?:-\S+ )*'?litgpt[^\s`')]*'?", text))
        found.update(f"{path.name}: {extra}" for extra in re.findall(r"\[[\w,]*\blitgpt\b[\w,]*\]", text))
    return found


def test_litgpt_is_installed_one_way_everywhere():
    assert installs_of_litgpt() == {LITGPT_INSTALL}
