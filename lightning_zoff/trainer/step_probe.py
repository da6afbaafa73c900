"""What the Trainer gives the plan to trace a step with (`placement/step_trace.py`): one batch of the train DataLoader
and the LightningModule's `training_step`, so that the plan counts the step's own GPU memory at setup and refuses a
batch that cannot fit before anything is allocated.

The batch is made as the DataLoader makes one, without iterating it (no worker starts, no sampler or random state
moves): its `collate_fn` over the dataset's first `batch_size` samples. A DataLoader of an `IterableDataset` or a
batch sampler of its own gives none (its next batch cannot be had without consuming it): the plan then counts no
activations and the first step's peak decides, as before. The hook that builds the DataLoaders of a DataModule or
LightningModule is called for it (Lightning calls it again when the loop starts), only where the step is traced.
The batch hooks run as in the loop: `on_before_batch_transfer` on the loader's batch, `on_after_batch_transfer` on the
traced one (its fake tensors, on the device); `transfer_batch_to_device` is not run (the trace puts the batch there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_zoff._compat_lightning import batch_hook, train_data_source
from lightning_zoff.placement import StepProbe


def step_probe(trainer: Any, module: nn.Module, forward_context: Callable[[], Any]) -> StepProbe:
    """The probe of `trainer`'s fit: its first train batch, made only if the plan traces it, and `module`'s
    `training_step` under the precision's `forward_context`."""
    return StepProbe(cache(lambda: before_transfer(module, first_batch(trainer))), training_loss(module),
                     forward_context)


def before_transfer(module: nn.Module, batch: Any) -> Any:
    """`batch` through the `on_before_batch_transfer` hook of `module`'s fit (None stays None)."""
    return None if batch is None else batch_hook(module, "on_before_batch_transfer", batch)


def first_batch(trainer: Any) -> Any:
    """One batch as `trainer`'s train DataLoader(s) would make it (a list or dict of them for several loaders, as
    Lightning combines them); None where a loader cannot give one without consuming it."""
    source = train_data_source(trainer)
    if source is None or not source.is_defined():
        return None
    return _batch_of(source.dataloader())


def _batch_of(loaders: Any) -> Any:
    if isinstance(loaders, DataLoader):
        dataset = loaders.dataset
        if isinstance(dataset, IterableDataset) or loaders.batch_size is None or not hasattr(dataset, "__len__"):
            return None
        samples = min(loaders.batch_size, len(dataset))
        return loaders.collate_fn([dataset[i] for i in range(samples)]) if samples else None
    if isinstance(loaders, Mapping):
        batches = {key: _batch_of(loader) for key, loader in loaders.items()}
        return None if any(b is None for b in batches.values()) else batches
    if isinstance(loaders, (list, tuple)):
        listed = [_batch_of(loader) for loader in loaders]
        return None if any(b is None for b in listed) else listed
    return None


def training_loss(module: nn.Module) -> Callable[[Any], torch.Tensor]:
    """`module.training_step`'s loss for a batch on the device, after its `on_after_batch_transfer` hook, with its
    logging switched off (the values are fake tensors)."""
    def loss_of(batch: Any) -> torch.Tensor:
        with _not_logging(module):
            batch = batch_hook(module, "on_after_batch_transfer", batch)
            output = module.training_step(batch, 0)  # type: ignore[operator]
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"training_step returned {type(output).__name__}, not a loss")
        return loss
    return loss_of


@contextmanager
def _not_logging(module: nn.Module) -> Iterator[None]:
    def ignore(*_: Any, **__: Any) -> None:
        return None

    names = ("log", "log_dict")
    for name in names:
        object.__setattr__(module, name, ignore)  # the instance's, over the class's method
    try:
        yield
    finally:
        for name in names:
            object.__delattr__(module, name)
