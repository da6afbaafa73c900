"""How many DataLoader workers each rank runs, read from what `fit` was given before any dataloader is built: the host
plan keeps room for them (`placement.machine.Machine.host_kept`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_zoff._compat_lightning import train_data_source

log = logging.getLogger("lightning_zoff")


def loader_workers(trainer: Any, configured: int | None) -> int:
    """`configured` (the strategy's `loader_workers`), else the workers of the train DataLoader(s) given to `fit`, else
    the `num_workers` that the DataModule or LightningModule whose hook builds them holds (as an attribute or a
    hyperparameter); 0 if none says. The hook itself is not called: it may be costly, and Lightning calls it later."""
    if configured is not None:
        return configured
    source = train_data_source(trainer)
    instance = getattr(source, "instance", None)
    if isinstance(instance, (pl.LightningModule, pl.LightningDataModule)):
        held = getattr(instance, "num_workers", None)
        if held is None and isinstance(getattr(instance, "hparams", None), Mapping):
            held = instance.hparams.get("num_workers")
        return held if isinstance(held, int) and not isinstance(held, bool) and held > 0 else 0
    return _workers_of(instance)


def _workers_of(loaders: Any) -> int:
    """The workers of a DataLoader, or of those in a list, tuple or dict (Lightning iterates them together)."""
    if isinstance(loaders, DataLoader):
        return loaders.num_workers
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        return sum(_workers_of(loader) for loader in loaders)
    return 0


def check_counted(dataloader: Any, counted: int | None) -> None:
    """Say once a train DataLoader has more workers than the host plan kept room for (`counted`)."""
    workers = _workers_of(dataloader)
    if counted is not None and workers > counted:
        log.warning("zoff: the train DataLoader runs %d workers per rank, the host plan kept room for %d; pass"
                    " ZoffStrategy(loader_workers=%d) to count them (the run stops itself should the host run short)",
                    workers, counted, workers)
