"""What a front door asks of the core: the calls `ShardedTraining` answers, in the order a door makes them, and who owns
what. The doors (`trainer.ZoffStrategy`, `fabric.ZoffFabricStrategy`) hold their rank's core as a `Core`, so mypy
checks that `ShardedTraining` meets it where `doors.FrontDoor` builds one; `tests/test_core_training.py` drives it with
no Lightning at all. docs/design.md ("The doors' contract") tells what each door translates into these calls.

Ownership: the door owns Lightning's objects (the Trainer or Fabric, the LightningModule's hooks, the loop, the
precision plugin, the LR schedulers, the process group's start) and the optimizer its user made; the core owns the
sharded module's FSDP2 units, the fp32 masters, the engine that holds the optimizer's state and steps it, the memory
plan and the checkpoint files. The door hands the core a `PrecisionMath` (its precision plugin is one) for the loss
scale and the clipping request, and never touches the engine's state itself.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from lightning_zoff.config import ZoffConfig
from lightning_zoff.offload import OffloadEngine, StepOutcome
from lightning_zoff.placement import StepProbe
from lightning_zoff.precision_math import PrecisionMath


class Core(Protocol):
    """One rank's sharded training, as a front door drives it. In order:

    1. `shard(module, ...)` once the ranks' process group is up: the module, in place, becomes FSDP2 units of 16-bit
       shards; the core keeps its fp32 masters (refusing, with offload, a model whose optimizer state cannot fit).
    2. `build_engine(optimizer)` with an optimizer over the sharded parameters: the engine takes the masters and the
       optimizer's state from now on (torch's own `optimizer.state` stays empty). A later call starts a new optimizer
       from fresh state and the masters the first left.
    3. Per micro-batch: the forward inside `forward()`, the backward inside `backward(window_ends, loss_scale)`;
       `window_ends`: this backward is its accumulation window's last (the step follows). The loss comes scaled by
       `loss_scale` (fp16, the precision's) and divided by the window's length (Lightning's closure or the Fabric
       loop does that).
    4. At each window's end: a clipping request, if any, in the precision (`PrecisionMath.request_clip`), then
       `step(optimizer, precision, step_index)`: the engine's update; its `StepOutcome` (norm, clip factor, skipped)
       is also `last_step`. The door zeroes nothing the core holds; `optimizer.zero_grad()` is harmless.
    5. Checkpoints, at any point after `shard` (each a collective: every rank calls it): `state_dict` and
       `optimizer_state` for the door's checkpoint dict, `save` to write it, `load` to restore weights and the
       optimizer's state in place (the rest of the dict returned, for the door), `load_full_state_dict` for whole
       weights, `full_state_dict` for the fp32 weights whole on every rank.
    6. `detach()` at the end of each run (the engine's thread and hooks go, its state stays for a later save);
       `close_engine()` frees that state.
    """

    @property
    def config(self) -> ZoffConfig: ...

    @property
    def module(self) -> nn.Module | None:
        """The sharded module, once `shard` ran."""

    @property
    def engine(self) -> OffloadEngine | None:
        """The engine, once `build_engine` ran."""

    @property
    def last_step(self) -> StepOutcome | None: ...

    @property
    def telemetry(self) -> dict[str, float]:
        """The last step's breakdown (forward, backward, exposed optimizer time, bytes moved)."""

    @property
    def memory_report(self) -> dict[str, float]:
        """The engine's memory by kind and side, as last reported."""

    def shard(self, module: nn.Module, param_dtype: torch.dtype, *, fitting: bool,
              accumulate_grad_batches: int = 1, loader_workers: int = 0,
              step_probe: StepProbe | None = None) -> None: ...

    def build_engine(self, optimizer: torch.optim.Optimizer, accumulate_grad_batches: int = 1) -> OffloadEngine: ...

    def forward(self) -> AbstractContextManager[None]: ...

    def backward(self, window_ends: bool, loss_scale: float) -> AbstractContextManager[None]: ...

    def step(self, optimizer: torch.optim.Optimizer, precision: PrecisionMath, step_index: int) -> StepOutcome: ...

    def make_room_after_oom(self) -> bool:
        """After a one-micro-batch window ran a single accelerator out of memory: room made for the same batch."""

    def state_dict(self) -> dict[str, Any]: ...

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None: ...

    def save(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None: ...

    def remove(self, path: Any) -> None: ...

    def load(self, path: Any, optimizer: torch.optim.Optimizer | None, weights_only: bool | None = None
             ) -> dict[str, Any]: ...

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor] | str | Path, strict: bool = True,
                             prefix: str | None = None) -> None: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...

    def detach(self) -> None: ...

    def close_engine(self) -> None: ...
