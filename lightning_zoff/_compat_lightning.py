"""Every private name of Lightning that zoff's two front doors (`trainer/`, `fabric/`) and their launch plumbing use,
in one place, so an upgrade that moves one breaks here (and in tests/test_compat.py). Checked on lightning 2.6.6."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher as FabricMultiProcessingLauncher,
)
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as FabricSubprocessScriptLauncher,
)
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized as distributed_is_initialized,
    _init_dist_connection as init_dist_connection,
    _sync_ddp_if_available as sync_ddp_if_available,
)
from lightning.pytorch.core.optimizer import _configure_optimizers
from lightning.pytorch.strategies.launchers import (
    _MultiProcessingLauncher as MultiProcessingLauncher,
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput as WorkerOutput

__all__ = [
    "FabricMultiProcessingLauncher", "FabricSubprocessScriptLauncher", "MultiProcessingLauncher",
    "SubprocessScriptLauncher", "WorkerOutput", "distributed_is_initialized", "fabric_strategy_precision",
    "init_dist_connection", "launcher_strategy", "optimizers_of", "set_fabric_strategy_precision",
    "set_strategy_launcher", "set_strategy_precision_plugin", "strategy_precision_plugin", "sync_ddp_if_available",
    "train_data_source",
]


def strategy_precision_plugin(strategy: Any) -> Any:
    """The precision plugin set on `strategy`, None while none is (Lightning's `precision_plugin` property would
    answer a default `Precision()` instead, where zoff needs its own)."""
    return strategy._precision_plugin


def set_strategy_precision_plugin(strategy: Any, plugin: Any) -> None:
    """Store `plugin` where Lightning's `Strategy.precision_plugin` reads it (zoff's property overrides that one)."""
    strategy._precision_plugin = plugin


def set_strategy_launcher(strategy: Any, launcher: Any) -> None:
    """Store `launcher` where Lightning's `Strategy.launcher` reads it: a strategy's `_configure_launcher` does so."""
    strategy._launcher = launcher


def launcher_strategy(launcher: Any) -> Any:
    """The strategy a Lightning multiprocessing launcher was built for."""
    return launcher._strategy


def optimizers_of(configured: Any) -> list[Any]:
    """The optimizers in what `configure_optimizers` returned (any of the forms Lightning accepts), as Lightning reads
    them; raises for a form it does not accept."""
    return _configure_optimizers(configured)[0]


def fabric_strategy_precision(strategy: Any) -> Any:
    """The precision plugin set on a Fabric `strategy`, None while none is (Fabric's `precision` property would answer
    a default `Precision()` instead)."""
    return strategy._precision


def set_fabric_strategy_precision(strategy: Any, plugin: Any) -> None:
    """Store `plugin` where Fabric's `Strategy.precision` reads it (zoff's property overrides that one)."""
    strategy._precision = plugin


def train_data_source(trainer: Any) -> Any:
    """The source of `fit`'s train data, before the fit loop loads it: `.instance` is what `fit` was given (DataLoaders,
    or the DataModule or LightningModule whose hook builds them), `.dataloader()` builds them as the loop will."""
    return getattr(getattr(trainer, "fit_loop", None), "_data_source", None)


def batch_hook(module: Any, name: str, batch: Any) -> Any:
    """The batch hook `name` (`on_before_batch_transfer`, `on_after_batch_transfer`) of `module`'s fit on `batch` of
    the first DataLoader, as the Trainer calls it: the DataModule's where the DataModule overrides it."""
    return module._call_batch_hook(name, batch, 0)
