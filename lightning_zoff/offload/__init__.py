"""The per-rank offload pipeline: gradient shards down, CPU update, parameter shards up.

What the rest of lightning_zoff uses of it, and nothing else (tests/test_layout.py holds code outside `offload/` to
these names): the engine, its step's outcome, and the views of its state checkpoints read. Where a unit's state lives
and what it costs is `lightning_zoff.placement`'s.
"""

from lightning_zoff.offload.engine import OffloadEngine, StepOutcome
from lightning_zoff.offload.unit_state import ParamState

__all__ = ["OffloadEngine", "ParamState", "StepOutcome"]
