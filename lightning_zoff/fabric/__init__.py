"""Fabric's front door: `Fabric(strategy="zoff")`. Glue over `lightning_zoff.training.ShardedTraining`, the object
the Trainer's door drives too."""

from lightning_zoff.fabric.precision import ZoffFabricPrecision
from lightning_zoff.fabric.strategy import ZoffFabricStrategy

__all__ = ["ZoffFabricPrecision", "ZoffFabricStrategy"]
