"""Each option's meaning has one source, its `ZoffConfig` field's doc, and shows where users look: `help()` (pydoc) of
`ZoffStrategy`, `ZoffFabricStrategy` and `ZoffConfig`, and the CLI's help for the strategy
(`python -m lightning_zoff.cli fit --trainer.strategy.help lightning_zoff.ZoffStrategy`)."""

from __future__ import annotations

import pydoc
import re
from dataclasses import fields

import pytest

from lightning_zoff import ZoffFabricStrategy, ZoffStrategy
from lightning_zoff.cli import main
from lightning_zoff.config import ZoffConfig, options_doc


def words(text: str) -> str:
    return " ".join(text.split())


def docs() -> dict[str, str]:
    return {f.name: words(f.metadata["doc"]) for f in fields(ZoffConfig)}


@pytest.mark.parametrize("cls", [ZoffStrategy, ZoffFabricStrategy, ZoffConfig])
def test_help_shows_every_option_with_its_meaning(cls):
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    shown = words(re.sub(r"\n\s*\|", "\n", text))  # pydoc's " |  " margin
    for name, doc in docs().items():
        assert f"{name}: {doc}" in shown, name
    assert cls.__doc__.count("\nArgs:\n") == 1


def test_the_cli_help_of_the_strategy_shows_every_option_with_its_meaning(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--trainer.strategy.help", "lightning_zoff.ZoffStrategy"], run=False)
    assert stop.value.code == 0
    # argparse wraps the help to the terminal's width, at spaces and hyphens: compared without white space
    shown = "".join(capsys.readouterr().out.split("Help for --trainer.strategy.help")[1].split())
    for name, doc in docs().items():
        assert f"--trainer.strategy.{name}" in shown, name
        assert "".join(f"{doc} (type: ".split()) in shown, name


def test_the_args_section_is_the_field_docs_in_field_order():
    names = re.findall(r"^    (\w+): ", options_doc(), re.MULTILINE)
    assert names == [f.name for f in fields(ZoffConfig)]
