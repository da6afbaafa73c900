"""Placement: where each unit's optimizer state lives (the host or the accelerator), how many bytes that takes, and
how it moves. Three parts, each a module:

- the plan (`plan.py`): every byte the engine allocates, per unit and side, frozen; made for the `Machine` a rank
  may use (`machine.py`), and refused with the options that would fit when it cannot (`refusal.py`);
- the step (`step_trace.py`): the step's own memory on the accelerator, traced on fake tensors at a batch's shape,
  which the plan counts beside the state;
- the policy (`policy.py`): what goes where, by the `accelerator_state` option: at setup (`plan_memory`, the one entry
  point that plans) and after a step measured the accelerator (the units to move there or back);
- the mechanism (`mover.py`): moving a unit's state as the policy chose, an exact copy that leaves nothing behind
  (`StateMover`, `relocate`), into host buffers zoff maps itself (`host_buffers.py`).

`RankMemory` (`rank.py`) drives them over a run for either front door: the machine read at setup, the plan checked
before sharding, "auto"'s moves after steps, room made after an out-of-memory error, the host's floor.

The package loads none of the step's pipeline (`offload/`), which builds on it: the engine plans its units here and
owns a `StateMover` (tests/test_layout.py holds both directions). What code outside `offload/` and this package uses
of it is exported here.
"""

from lightning_zoff.placement.machine import Machine, margin_bytes
from lightning_zoff.placement.mover import StateMover
from lightning_zoff.placement.plan import MemoryPlan, Placement, StateOptions, UnitShape
from lightning_zoff.placement.policy import plan_memory
from lightning_zoff.placement.rank import RankMemory
from lightning_zoff.placement.refusal import PlanDoesNotFit
from lightning_zoff.placement.step_trace import StepProbe

__all__ = [
    "Machine",
    "MemoryPlan",
    "Placement",
    "PlanDoesNotFit",
    "RankMemory",
    "StateMover",
    "StateOptions",
    "StepProbe",
    "UnitShape",
    "margin_bytes",
    "plan_memory",
]
