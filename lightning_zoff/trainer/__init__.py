"""The Trainer's front door: `Trainer(strategy="zoff")`. Glue over `lightning_zoff.training.ShardedTraining`."""

from lightning_zoff.trainer.precision import ZoffPrecision
from lightning_zoff.trainer.stats_monitor import ZoffStatsMonitor
from lightning_zoff.trainer.strategy import ZoffStrategy

__all__ = ["ZoffPrecision", "ZoffStatsMonitor", "ZoffStrategy"]
