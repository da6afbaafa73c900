"""LightningCLI with the "zoff" strategy names registered:

    python -m lightning_zoff.cli fit --config conf/cli/gpt_tiny.yaml [--trainer.max_steps=3]

Model and data are chosen by `class_path` (any LightningModule / LightningDataModule), the strategy by its registered
name (`zoff`, `zoff_no_offload`) or as `class_path: lightning_zoff.ZoffStrategy` with `init_args`. The progress bar and
the quiet output are the main job's (`lightning_zoff.app.progress`, `lightning_zoff.app.quiet`).

A bad value (one the parser refuses, an unknown option, a strategy name or a Trainer or class argument refused at
construction) stops in at most three lines on stderr, `error: --key=value: ...` with what is accepted, and exit status
2, instead of the parser's usage dump or a traceback; `JSONARGPARSE_DEBUG=1` gives jsonargparse's own message.
"""

import difflib
import os
import pydoc
import re
import sys
from typing import Any, NoReturn

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_utilities.core.imports import RequirementCache
from typing_extensions import override

import lightning_zoff  # noqa: F401  registers the strategy names before the trainer's arguments are parsed
from lightning_zoff.app.progress import progress_bar
from lightning_zoff.app.quiet import QuietRanks, quiet
from lightning_zoff.config import removed_option
from lightning_zoff.doors import FrontDoor
from lightning_zoff.placement import PlanDoesNotFit

_CLI_EXTRA = RequirementCache("jsonargparse[signatures]>=4.27.7")  # what LightningCLI itself requires


def refuse(message: str) -> NoReturn:
    """Stop before anything runs: the message on one line, the options' listing named, exit status 2."""
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    print("python -m lightning_zoff.cli fit --help lists the options", file=sys.stderr)
    raise SystemExit(2)


def short_parse_error(message: str, options: list[str]) -> str:
    """jsonargparse's message (a tree of the union's alternatives) as `--key=value: expected ...`: the innermost key,
    its value and what it accepts; an unknown option with the nearest known ones."""
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        given = [arg.split("=", 1)[0] for arg in unknown.group(1).split() if arg.startswith("--")]
        near = [match for arg in given for match in difflib.get_close_matches(arg, options, n=3)]
        return f"unknown option {unknown.group(1)}" + (f"; did you mean {', '.join(near)}?" if near else "")
    keys = re.findall(r'Parser key "([^"]+)"', message)
    key = ".".join(keys)
    expected = re.findall(r"Expected (?:a )?(.*?)\. Got value: (.*)", message)
    if expected:
        accepted, value = expected[-1]
        accepted = re.sub(r"<class '([\w.]+)'>", r"\1", accepted).replace("typing.Literal", "one of ")
        return f"--{key}={value}: expected {accepted}"
    problem = re.search(r"Problem with given class_path '([^']+)':\s*(.*)", message)
    if problem:
        removed = removed_strategy_option(key, problem.group(1), problem.group(2), message)
        return removed or f"--{key}.class_path={problem.group(1)}: {problem.group(2)}"
    # a class's own refusal at construction, among the union's alternatives that did not apply
    refused = [line.strip()[2:] for line in message.splitlines() if line.strip().startswith("- ")
               and not line.strip().startswith("- Expected a <class")]
    if refused:
        class_path = re.search(r"class_path='([^']+)'", message)
        return f"{class_path.group(1)}: {refused[0]}" if class_path else refused[0]
    single = re.match(r'Parser key "([^"]+)": (.*)', message)
    if single:
        return f"--{single.group(1)}: {single.group(2)}"
    return message


def removed_strategy_option(key: str, class_path: str, problem: str, message: str) -> str | None:
    """`--key.name=value: why it went`, where jsonargparse's `problem` with `class_path` is an option that one of zoff's
    strategies no longer has; else None."""
    refused = re.fullmatch(r"Option '(\w+)' is not accepted", problem)
    target = pydoc.locate(class_path)
    if refused is None or not (isinstance(target, type) and issubclass(target, FrontDoor)):
        return None
    why = removed_option(refused.group(1))
    if why is None:
        return None
    value = re.search(r"NestedArg\(key='\w+', val='(.*)'\)", message)  # given on the command line, not in a file
    return f"--{key}.{refused.group(1)}{'=' + value.group(1) if value else ''}: {why}"


class OneLineErrorParser(LightningArgumentParser):
    """LightningCLI's parser, whose refusals are `refuse`'s lines instead of the usage and jsonargparse's tree."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            super().error(message, ex)  # raising, as jsonargparse does while it tries a union's alternatives
        parser = getattr(ex, "subcommand_parser", None) or self
        refuse(short_parse_error(message, list(parser._option_string_actions)))


class ZoffCLI(LightningCLI):
    """LightningCLI whose Trainer also gets `QuietRanks` and the main job's progress bar (unless the configuration
    turns the bar off or gives one), and whose bad values stop in one line (`refuse`)."""

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (TypeError, ValueError, MisconfigurationException) as err:  # a class refused a value at construction
            refuse(short_parse_error(str(err), []))

    @override
    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        trainer_config = self._get(self.config_init, "trainer", default={})
        strategy = trainer_config.get("strategy")
        if isinstance(strategy, str) and strategy != "auto" and strategy not in StrategyRegistry:
            names = StrategyRegistry.available_strategies()
            zoff = [name for name in names if name.startswith("zoff")]
            lightning = [name for name in names if name not in zoff and "_find_unused_parameters_" not in name]
            raise ValueError(f"--trainer.strategy={strategy}: no such strategy; zoff's: {', '.join(zoff)}; Lightning's:"
                             f" auto, {', '.join(lightning)}")
        given = kwargs.pop("callbacks", None) or trainer_config.get("callbacks")
        callbacks = [*(given if isinstance(given, list) else [given] if given else []), QuietRanks()]
        enabled = trainer_config.get("enable_progress_bar") is not False
        if enabled and not any(isinstance(callback, ProgressBar) for callback in callbacks):
            callbacks.append(progress_bar())
        return super().instantiate_trainer(callbacks=callbacks, **kwargs)


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    if not _CLI_EXTRA:
        raise SystemExit("python -m lightning_zoff.cli needs LightningCLI's parser: pip install 'lightning-zoff[cli]'"
                         " (or, from a checkout, pip install -e '.[cli]').")
    quiet()  # ranks started by running the command again pass here too
    try:
        return ZoffCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                       parser_class=OneLineErrorParser, args=args, run=run)
    except PlanDoesNotFit as err:  # the ranks' plan, at setup, before anything was sharded: its numbers and options
        if os.environ.get("LOCAL_RANK", "0") == "0":  # the ranks this command started again refuse alike, silently
            print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
