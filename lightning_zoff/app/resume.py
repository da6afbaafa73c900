"""The main job's `ckpt_path=`, checked in the main process before any rank starts: which checkpoint, whether it can
load into this model, and whether the run has anything left to train. Each refusal is one line (a ValueError naming
`ckpt_path`) that says what to change.

A checkpoint is read for its metadata only: meta.pt of a sharded directory, or a full file memory-mapped (no tensor is
read). `ckpt_path=last` is the newest `checkpoints/last.ckpt` under outputs/ whose job trained this model: the same
composed `model` configuration in the job's `.hydra/config.yaml` (Hydra writes it next to `checkpoints/`). On Ctrl-C
the job says which checkpoint to resume and how (`ResumeOnInterrupt`).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from lightning_zoff.checkpoint import files as checkpoint_files
from lightning_zoff.trainer.loops import fabric_step_count


def find_checkpoint(ckpt_path: str, outputs: Path, model: DictConfig, model_choice: str) -> Path:
    """`ckpt_path` as a path that exists; `last`: the newest checkpoints/last.ckpt under `outputs` of a job with the
    model configuration `model` (the option `model_choice`, for the message)."""
    if ckpt_path != "last":
        path = Path(ckpt_path).expanduser().absolute()
        if not path.exists():
            raise ValueError(f"ckpt_path={ckpt_path}: no such file or directory")
        return path
    found = sorted(outputs.glob("**/checkpoints/last.ckpt"), key=lambda path: path.stat().st_mtime, reverse=True)
    if not found:
        raise ValueError(f"ckpt_path=last: no checkpoints/last.ckpt under {_shown(outputs)}")
    wanted = cast(dict, OmegaConf.to_container(model, resolve=True))
    for path in found:
        if _job_model(path) == wanted:
            return path
    newest = found[0]
    raise ValueError(f"ckpt_path=last: the newest {_shown(newest)} is of {_described(newest, wanted, model_choice)},"
                     f" and no other under {_shown(outputs)} is of this model; give the model options it was trained"
                     " with, or name a checkpoint: ckpt_path=PATH")


def read_checkpoint(path: Path, label: str, expected: dict[str, list[int]] | None) -> dict[str, Any] | None:
    """The checkpoint's metadata (Lightning's checkpoint without its tensors), refused as every rank's load would
    refuse it: unreadable, truncated, of another format version or (`expected`: the model's state dict shapes, zoff's
    checkpoints) of another model. None for a directory zoff did not write (another strategy's: its load checks it)."""
    try:
        checkpoint = checkpoint_files.check_loadable(path) if expected is not None else None
        if expected is None and path.is_dir():
            return None
        if checkpoint is None:
            checkpoint = checkpoint_files.read(path)
        if expected is not None:
            checkpoint_files.check_compatible(checkpoint, path, expected)
    except checkpoint_files.CheckpointError as err:
        raise ValueError(f"{label}: {err}") from None
    return checkpoint


def check_trains(checkpoint: dict[str, Any], trainer: DictConfig, label: str) -> None:
    """Refuse a resume that would stop at once: the checkpoint already at `trainer.max_steps` (or `max_epochs`), or
    that would train every step again: a checkpoint of `fabric.save` that holds no step count (`fabric_step_count`)."""
    fabric_step_count(checkpoint, label)
    step, epoch = checkpoint.get("global_step", 0), checkpoint.get("epoch", 0)
    max_steps, max_epochs = trainer.get("max_steps", -1), trainer.get("max_epochs")
    if max_steps is not None and 0 <= max_steps <= step:
        raise ValueError(f"{label}: the checkpoint is at step {step} and trainer.max_steps={max_steps}: nothing to"
                         f" train; raise trainer.max_steps above {step}")
    if max_epochs is not None and 0 <= max_epochs <= epoch:
        raise ValueError(f"{label}: the checkpoint has done {epoch} epoch(s) and trainer.max_epochs={max_epochs}:"
                         f" nothing to train; raise trainer.max_epochs above {epoch} (or leave it null)")


def label(ckpt_path: str, path: Path) -> str:
    """How messages name the checkpoint: as given, and where `last` found it."""
    return f"ckpt_path={ckpt_path}" + (f" ({_shown(path)})" if ckpt_path == "last" else "")


def _job_model(checkpoint: Path) -> Any:
    """The model configuration of the job that wrote `checkpoint` (<job>/checkpoints/last.ckpt), None if unknown."""
    try:
        saved = OmegaConf.load(checkpoint.parents[1] / ".hydra" / "config.yaml")
        return OmegaConf.to_container(saved.model, resolve=True)
    except Exception:  # no config.yaml, or one this version cannot read: not known to be this model
        return None


def _described(checkpoint: Path, wanted: dict, model_choice: str) -> str:
    """Which model the job of `checkpoint` trained, beside this run's `wanted` (the option `model_choice`)."""
    job = checkpoint.parents[1] / ".hydra"
    saved = _job_model(checkpoint)
    if not isinstance(saved, dict):
        return f"an unknown model (no readable {_shown(job / 'config.yaml')})"
    try:
        choice = OmegaConf.load(job / "hydra.yaml").hydra.runtime.choices.model
    except Exception:  # a job without Hydra's record of its options: the class stands for the option
        choice = saved.get("_target_")
    if choice != model_choice:
        return f"model {choice}, not {model_choice}"
    differ = [key for key in sorted(saved.keys() | wanted.keys()) if saved.get(key) != wanted.get(key)]
    return (f"model {choice} with " + ", ".join(f"{key}={saved.get(key)}" for key in differ[:3]) + ", not "
            + ", ".join(f"{key}={wanted.get(key)}" for key in differ[:3]))


def _shown(path: Path) -> str:
    """`path` relative to the working directory where it is inside it."""
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


class ResumeOnInterrupt(pl.Callback):
    """On Ctrl-C (KeyboardInterrupt), the main process prints where the run can go on from: the last checkpoint at
    `path` and its step, and `command` with `ckpt_path=` that resumes it; or that none was saved yet. Once: the ranks
    (forked from the main process, or started by it) have their own interrupt and stay silent."""

    def __init__(self, path: Path | None, command: list[str]) -> None:
        self.path, self.command, self.pid = path, command, os.getpid()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, KeyboardInterrupt) or os.getpid() != self.pid:
            return
        if self.path is None or not self.path.exists():
            print("interrupted before any checkpoint was saved: nothing to resume", file=sys.stderr, flush=True)
            return
        try:
            step = f" (step {checkpoint_files.read(self.path).get('global_step')})"
        except checkpoint_files.CheckpointError:
            step = ""
        kept = [arg for arg in self.command if not arg.startswith(("ckpt_path=", "+ckpt_path="))]
        print(f"interrupted: the last checkpoint is {_shown(self.path)}{step}; resume it with\n  "
              + shlex.join([*kept, f"ckpt_path={_shown(self.path)}"]), file=sys.stderr, flush=True)
