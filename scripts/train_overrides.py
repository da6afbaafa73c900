"""The main job's command line, checked before Hydra runs: every `key=value` and `+key=value` must name a key that
something reads, or the job stops with the keys that exist (Hydra would name only the bad key, after suggesting to add
it with `+`, and accepts any `+key` that the job then ignores)."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from lightning_zoff.config import removed_option
from lightning_zoff.doors import FrontDoor

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = {path.name for path in CONF.iterdir() if path.is_dir() and path.name != "cli"}  # trainer, strategy, ...
# a group choice the configuration can be composed with: one option, not a sweep (`optimizer=adamw,lion`)
CHOICE = re.compile(r"\+{0,2}(\w+)=[\w.]+")


def unknown_keys(argv: list[str]) -> list[str]:
    """One message for each override of `argv` that names a key the configuration does not have, listing the keys its
    parent has. `+key=value` adds a key only where it is passed on to a constructor that takes it (a Trainer argument,
    a `_target_`'s, a value of an empty mapping such as model.config): anywhere else nothing would read it."""
    overrides = [arg for arg in argv if "=" in arg and not arg.startswith("-")]  # flags aside (-m, --cfg job)
    choices = [arg for arg in overrides if arg.split("=", 1)[0].lstrip("+~") in GROUPS]
    simple = [arg for arg in choices if CHOICE.fullmatch(arg)]
    swept = {arg.split("=", 1)[0].lstrip("+~") for arg in choices if arg not in simple}
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("train", overrides=simple)
    except Exception:  # a choice that does not exist: Hydra's own message lists the options
        return []
    messages = []
    for arg in overrides:
        written = arg.split("=", 1)[0]
        key = written.lstrip("+~")
        if arg in choices or written.startswith("~") or key.startswith("hydra.") or key.split(".")[0] in swept:
            continue
        message = _unknown(cfg, key, adding=written.startswith("+"))
        if message:
            messages.append(message)
    return messages


def _unknown(cfg: DictConfig, key: str, adding: bool) -> str | None:
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    while not OmegaConf.is_dict(node):  # a parent that is missing too: name the nearest one there is
        parent, _, name = parent.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
    where = parent or "the configuration"
    why = _removed(node, name)
    if why is not None:
        return f"'{key}': {why}"
    if name in node:
        return f"'+{key}' adds a key that exists; set it with {key}=..." if adding else None
    if len(node) == 0:  # a mapping of free keys (model.config: values over a preset's)
        return None if adding else f"'{key}' does not exist; {where} is empty: add the key with +{key}=..."
    arguments = _arguments(parent, node)
    if adding and arguments is not None and (arguments.any or name in arguments.names):
        return None
    message = f"'{key}' does not exist; {where} has: {', '.join(sorted(node))}"
    if arguments is not None and name in arguments.names:
        message += f" (an argument of its constructor that is not listed: +{key}=...)"
    return message


@dataclass
class Arguments:
    names: set[str]
    any: bool  # **kwargs, or a class that is not installed (its own error comes when the job builds it)


def _arguments(parent: str, node: DictConfig) -> Arguments | None:
    """The arguments of the constructor that `node`'s keys are passed to; None where there is none (the top level,
    `sample`: the job reads those keys by name)."""
    if parent == "trainer":
        target: Any = pl.Trainer
    elif "_target_" in node:
        try:
            target = get_object(node._target_)
        except Exception:
            return Arguments(set(), any=True)
    else:
        return None
    parameters = inspect.signature(target).parameters
    return Arguments(set(parameters), any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()))


def _removed(node: DictConfig, name: str) -> str | None:
    """Why zoff removed its option `name`, where `node` configures one of zoff's strategies; else None."""
    why = removed_option(name)
    if why is None or "_target_" not in node:
        return None
    try:
        target = get_object(node._target_)
    except Exception:
        return None
    return why if isinstance(target, type) and issubclass(target, FrontDoor) else None


# flags that change which configuration Hydra composes, or that compose none: the check below leaves those to Hydra
OTHER_CONFIG = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--help", "-h", "--hydra-help",
                "--info", "-i", "--shell-completion", "-sc")


def hydra_refusal(argv: list[str]) -> str | None:
    """Hydra's own refusal of `argv` in one line (Hydra prints 13 and exits 1), or None where the configuration
    composes: an override it cannot parse, a group option that does not exist (named with the options there), a sweep
    without -m. Under -m every value of a swept override is composed, each with the others' first values; glob and
    interval sweeps are Hydra's to check."""
    if any(arg.split("=", 1)[0] in OTHER_CONFIG for arg in argv):
        return None
    overrides = [arg for arg in argv if "=" in arg and not arg.startswith("-")]
    parser = OverridesParser.create()
    parsed = []
    for arg in overrides:
        try:
            parsed += parser.parse_overrides([arg])
        except OverrideParseException as err:
            return f"Hydra cannot read '{arg}': {str(err).splitlines()[0]} (see Hydra's override grammar)"
    variants = [overrides]
    if "-m" in argv or "--multirun" in argv:
        lines = [_lines(override) for override in parsed]
        first = [choices[0] for choices in lines if choices]
        variants = [first]
        for i, choices in enumerate(line for line in lines if line):
            variants += [[*first[:i], choice, *first[i + 1:]] for choice in choices[1:]]
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            for variant in variants:
                compose("train", overrides=variant)
    except MissingConfigException as err:
        if err.options is None or err.missing_cfg_file is None:
            return _one_line(err)
        group, _, name = err.missing_cfg_file.rpartition("/")
        return f"{group}={name}: no such option; {group} has: {', '.join(err.options)}"
    except HydraException as err:
        return _one_line(err)
    return None


def _lines(override: Override) -> list[str]:
    """The overrides a -m command line's `override` stands for in turn ([] for a sweep Hydra expands itself)."""
    if not override.is_sweep_override():
        return [override.input_line]
    try:
        return [f"{override.get_key_element()}={value}" for value in override.sweep_string_iterator()]
    except Exception:  # glob (needs the config loader), interval (a sweeper's to sample)
        return []


def _one_line(err: Exception) -> str:
    """Hydra's message and its cause's, on one line, without the config search path it appends."""
    lines = [line.strip() for line in str(err).split("\nConfig search path:")[0].splitlines() if line.strip()]
    if err.__cause__ is not None:
        lines.append(str(err.__cause__).splitlines()[0])
    return "; ".join(lines)
