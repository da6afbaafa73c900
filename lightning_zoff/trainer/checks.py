"""What ZoffStrategy refuses beyond what either door does (`lightning_zoff.doors`), each as early as it can be known:
the Trainer's settings and the model in setup (and in the launcher, before any rank starts, with the optimizer); a
predict dataloader before its first batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper

from lightning_zoff._compat_lightning import distributed_is_initialized, optimizers_of
from lightning_zoff.doors import check_optimizers


def check_supported(trainer: Any, module: Any) -> None:
    """Refuse what the strategy cannot train: manual optimization, clipping by value, SyncBatchNorm on CPU ranks."""
    if not module.automatic_optimization:
        raise ValueError(
            "strategy='zoff' supports automatic optimization only: the optimizer step runs inside the"
            " strategy. Remove `self.automatic_optimization = False` or use another strategy."
        )
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
        raise ValueError(
            "strategy='zoff' clips gradients by norm only; use gradient_clip_algorithm='norm' (the default)."
        )
    strategy = trainer.strategy
    if getattr(strategy, "_layer_sync", None) is not None and strategy.root_device.type == "cpu":
        raise ValueError(
            "sync_batchnorm=True: torch's SyncBatchNorm synchronises batch statistics on GPUs only, and these ranks"
            " run on the CPU. Use sync_batchnorm=False there (each rank then keeps its own running statistics)."
        )


def check_configured_optimizers(module: Any) -> None:
    """`check_optimizers` on what `module.configure_optimizers()` returns when run in this process before the ranks
    start: on the module as built so far, attached to no Trainer and under torch.device("meta") (whatever it allocates
    costs nothing). A configure_optimizers that needs what only a rank has (the Trainer, a model built in
    configure_model) fails here; that failure is not the user's mistake, and the ranks then run it for real."""
    if _attached(module):  # to an earlier run's Trainer, whose state it could read or change
        return
    try:
        with torch.device("meta"):
            configured = module.configure_optimizers()
        optimizers = optimizers_of(configured)
    except Exception:
        return
    if configured is not None:  # none: Lightning warns and the ranks refuse its stand-in
        check_optimizers(optimizers)


def _attached(module: Any) -> bool:
    try:
        return module.trainer is not None
    except RuntimeError:  # Lightning's answer for a module not attached to a Trainer, as before its first fit
        return False


def check_predict_batches(dataloader: Any, world_size: int) -> None:
    """A collective: every rank must get as many batches. Lightning's predict sampler does not repeat samples, so
    ranks can get different batch counts; a sharded forward then waits forever for the rank that ran out."""
    sampler = getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)
    if isinstance(sampler, UnrepeatedDistributedSamplerWrapper) and distributed_is_initialized():
        counts = [None] * world_size
        dist.all_gather_object(counts, len(dataloader))
        if len(set(counts)) > 1:
            raise ValueError(
                f"zoff: the predict dataloader gives ranks different batch counts {counts}; every rank must"
                f" run the same number of sharded forwards. Pad the dataset to a multiple of"
                f" world_size x batch_size ({world_size} x {dataloader.batch_size})."
            )
