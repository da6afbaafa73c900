"""The per-rank offload pipeline: gradient shards down, CPU update, parameter shards up.

What the rest of lightning_zoff uses of it, and nothing else (tests/test_layout.py holds code outside `offload/` to
these names): the engine, and the memory plan a rank checks before it shards (`Memory`, scripts/checks/find_largest.py).
"""

from lightning_zoff.offload.engine import OffloadEngine, StepOutcome, describe_memory
from lightning_zoff.offload.layout import padded_shard_numel
from lightning_zoff.offload.memory_plan import (
    Machine,
    MemoryPlan,
    PlanDoesNotFit,
    StateOptions,
    UnitShape,
    accelerator_holds_all,
    measure_machine,
    plan_memory,
    size,
)
from lightning_zoff.offload.moves import back_for_room
from lightning_zoff.offload.placement import Placement, margin_bytes
from lightning_zoff.offload.unit_state import ParamState

__all__ = [
    "Machine",
    "MemoryPlan",
    "OffloadEngine",
    "ParamState",
    "Placement",
    "PlanDoesNotFit",
    "StateOptions",
    "StepOutcome",
    "UnitShape",
    "accelerator_holds_all",
    "back_for_room",
    "describe_memory",
    "margin_bytes",
    "measure_machine",
    "padded_shard_numel",
    "plan_memory",
    "size",
]
