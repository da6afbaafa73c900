"""The per-rank offload pipeline: gradient shards down, CPU update, parameter shards up."""

from lightning_zoff.offload.engine import OffloadEngine, StepOutcome, describe_memory

__all__ = ["OffloadEngine", "StepOutcome", "describe_memory"]
