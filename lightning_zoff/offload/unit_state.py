"""One FSDP2 unit's optimizer state on one rank, and where the unit is in its accumulation window.

The state covers only the parameters the optimizer trains (`trained`): their fp32 master rows and moments back to
back, each parameter padded as in FSDP2's flat shard. Frozen parameters and those outside the optimizer are never
updated, so their value lives on the accelerator alone.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_zoff.offload.buffers import host_empty
from lightning_zoff.offload.layout import ParamSlot, UnitLayout
from lightning_zoff.optim.rules import GroupHyperparams


class Placement(enum.Enum):
    """Where a unit's master and moments live and its update runs."""

    HOST = "host"  # the fused CPU kernels; gradients come down, 16-bit parameters go up
    ACCELERATOR = "accelerator"  # torch ops next to the parameters


class Phase(enum.Enum):
    """A unit's place in the accumulation window: EMPTY -> SUMMING* -> READY -> FINALIZING -> EMPTY."""

    EMPTY = "no gradient in this window yet"
    SUMMING = "part of the window's gradient is in the sum, more micro-batches may add to it"
    READY = "the window's whole gradient is on the host (in `window_grad`) with its sum of squares"
    FINALIZING = "the step is decided; the update is not yet on its way to the accelerator"


@dataclass
class TrainedParam:
    """A parameter the optimizer trains: its place in the unit's flat gradient and in the unit's state."""

    slot: ParamSlot
    slot_index: int  # in the unit's layout.slots (and in its used-flags)
    state_offset: int  # start of its padded rows in the unit's master and moments
    group_index: int
    step: int = 0  # optimizer steps it took (as torch counts: the steps in which it had a gradient)


@dataclass(frozen=True)
class Run:
    """Trained parameters that one kernel call updates: adjacent in the flat gradient and in the state, of one param
    group, at one step count."""

    grad_start: int
    state_start: int
    numel: int
    group_index: int
    step: int  # the step this update makes (1-based)


def kernel_runs(trained: list[TrainedParam], used: list[bool]) -> tuple[Run, ...]:
    """The fewest kernel calls that update exactly the trained parameters flagged in `used`."""
    runs: list[Run] = []
    for param, is_used in zip(trained, used, strict=True):
        if not is_used:
            continue
        last = runs[-1] if runs else None
        if (last is not None and last.grad_start + last.numel == param.slot.offset
                and last.state_start + last.numel == param.state_offset
                and (last.group_index, last.step) == (param.group_index, param.step + 1)):
            runs[-1] = Run(last.grad_start, last.state_start, last.numel + param.slot.padded_numel, last.group_index,
                           last.step)
        else:
            runs.append(Run(param.slot.offset, param.state_offset, param.slot.padded_numel, param.group_index,
                            param.step + 1))
    return tuple(runs)


@dataclass(frozen=True)
class UpdateKey:
    """What an update's result depends on besides the state and the gradient."""

    scale: float
    runs: tuple[Run, ...]
    hyper: tuple[GroupHyperparams, ...]  # of each run


@dataclass(eq=False)  # compared by identity
class UnitState:
    layout: UnitLayout
    placement: Placement
    trained: list[TrainedParam]  # in flat order
    grad_spans: list[tuple[int, int]]  # runs of the flat gradient the trained parameters cover (their norm)
    state: list[torch.Tensor]  # [master fp32, exp_avg, exp_avg_sq]; Lion has no exp_avg_sq; moments fp32 or bf16
    spare: list[torch.Tensor] | None  # a speculation's buffers, lent by the SparePool until the step is decided
    # sum of this window's micro-batch gradients (a sum over ranks too); fp32 by default; None until a window of
    # several micro-batches needs it
    grad_sum: torch.Tensor | None
    grad_staging: torch.Tensor  # param dtype, pinned: lands the reduced shard (layout.flat_numel)
    param_staging: torch.Tensor  # param dtype, pinned, laid out as master: leaves for the accelerator (fp32: master)
    used: list[bool]  # per slot: it got a gradient on this rank in this window
    phase: Phase = Phase.EMPTY
    window_grad: torch.Tensor | None = None  # grad_staging (a window of one micro-batch) or grad_sum; None if EMPTY
    sumsq: float | None = None  # of the window's gradient, once READY
    speculation: UpdateKey | None = None  # what the state in `spare` was computed with
    device_sum: torch.Tensor | None = None  # the window's sum on the accelerator (accumulate_on_accelerator)
    grad_copied: torch.cuda.Event | None = None
    params_copied: torch.cuda.Event | None = None
    staging_free: threading.Event = field(default_factory=threading.Event)  # grad_staging may be overwritten

    @property
    def master(self) -> torch.Tensor:
        return self.state[0]

    @property
    def moments(self) -> dict[str, torch.Tensor]:
        return dict(zip(("exp_avg", "exp_avg_sq"), self.state[1:], strict=False))

    @property
    def device(self) -> torch.device:
        return self.master.device

    @property
    def fp32_params(self) -> bool:
        """The parameters are fp32 (32-true): they go back to the accelerator straight from the master."""
        return self.param_staging is self.master

    def rows(self, param: TrainedParam, flat: torch.Tensor) -> torch.Tensor:
        """The parameter's unpadded rows in one of the unit's state-laid buffers (master, moments, param_staging)."""
        return flat[param.state_offset : param.state_offset + param.slot.numel]

    def swap_spare(self) -> list[torch.Tensor]:
        """Make the spare buffers (a kept speculation) the state; returns the old state, for the pool."""
        assert self.spare is not None
        fp32_params = self.fp32_params
        old, self.state, self.spare = self.state, self.spare, None
        if fp32_params:
            self.param_staging = self.master
        return old

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the unit holds for the optimizer (what its memory is)."""
        tensors = [*self.state, self.grad_staging]  # (a lent spare set is the pool's)
        tensors += [] if self.grad_sum is None else [self.grad_sum]
        return tensors + ([] if self.fp32_params else [self.param_staging])


def build_unit_state(
    layout: UnitLayout,
    masters: dict[int, torch.Tensor],
    group_of: dict[int, int],
    *,
    placement: Placement,
    device: torch.device,
    moments: int,
    moment_dtype: torch.dtype,
    sums_windows: bool,
    grad_sum_dtype: torch.dtype,
    pin: bool,
) -> UnitState:
    """State for the unit's trained parameters on `device`, their rows taken from `masters` (fp32 shards by id of
    the sharded parameter), which are consumed: the model's fp32 copies are freed as the state fills."""
    trained, state_numel = [], 0
    for index, slot in enumerate(layout.slots):
        group = group_of.get(id(slot.param))
        if group is not None:
            trained.append(TrainedParam(slot, index, state_numel, group))
            state_numel += slot.padded_numel
    state = [torch.zeros(state_numel, dtype=dtype, device=device)
             for dtype in [torch.float32] + [moment_dtype] * moments]
    for param in trained:
        state[0][param.state_offset : param.state_offset + param.slot.numel].copy_(
            masters.pop(id(param.slot.param)).reshape(-1))
    for p in [*(s.param for s in layout.slots), *layout.frozen]:
        masters.pop(id(p), None)
    spans: list[tuple[int, int]] = []
    for param in trained:
        start, end = param.slot.offset, param.slot.offset + param.slot.padded_numel
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    param_dtype = (layout.slots[0].param if layout.slots else layout.frozen[0]).dtype
    unit = UnitState(layout, placement, trained, spans, state, spare=None, grad_sum=None,
                     grad_staging=state[0], param_staging=state[0], used=[False] * len(layout.slots))
    _make_buffers(unit, param_dtype, device, sums_windows=sums_windows, grad_sum_dtype=grad_sum_dtype, pin=pin)
    unit.staging_free.set()
    return unit


def relocate(unit: UnitState, placement: Placement, device: torch.device, *, grad_sum_dtype: torch.dtype, pin: bool
             ) -> None:
    """Move the unit's state to `device` (exact copies) and make its buffers there; on failure nothing changes.
    Between windows only."""
    assert unit.phase is Phase.EMPTY
    assert unit.speculation is None
    assert unit.spare is None
    param_dtype = unit.grad_staging.dtype
    before = (unit.state, unit.placement, unit.grad_sum, unit.grad_staging, unit.param_staging)
    try:
        unit.state = [t.to(device, copy=True) for t in unit.state]  # pageable, as built: only the copies' buffers pin
        unit.placement = placement
        _make_buffers(unit, param_dtype, device, sums_windows=unit.grad_sum is not None,
                      grad_sum_dtype=grad_sum_dtype, pin=pin)
    except BaseException:  # out of memory on the way: the unit stays as it was
        unit.state, unit.placement, unit.grad_sum, unit.grad_staging, unit.param_staging = before
        raise
    unit.grad_copied = unit.params_copied = None


def _make_buffers(unit: UnitState, param_dtype: torch.dtype, device: torch.device, *, sums_windows: bool,
                  grad_sum_dtype: torch.dtype, pin: bool) -> None:
    """The unit's working buffers next to its state: the window's gradient sum, the staging buffers the gradient lands
    in and the 16-bit parameters leave from."""
    n = unit.layout.flat_numel
    unit.grad_sum = host_empty(n, grad_sum_dtype, device, pin).zero_() if sums_windows else None
    unit.grad_staging = host_empty(n, param_dtype, device, pin)
    if param_dtype == torch.float32:
        unit.param_staging = unit.master  # fp32 shards (32-true) go back straight from the master
    else:
        unit.param_staging = host_empty(unit.master.numel(), param_dtype, device, pin)
        unit.param_staging.copy_(unit.master)


@dataclass(frozen=True)
class ParamState:
    """One sharded parameter's optimizer state on this rank, as views into the unit's state (valid until the next
    step): what checkpoints save and load in place."""

    param: nn.Parameter  # the sharded (DTensor) parameter
    master: torch.Tensor | None  # fp32 rows shaped as the local shard; None: not trained (its value is the param's)
    moments: dict[str, torch.Tensor]  # "exp_avg"[, "exp_avg_sq"], shaped as the local shard
    step: int

    @property
    def local(self) -> torch.Tensor:
        """This rank's shard of the parameter on the accelerator."""
        return cast(DTensor, self.param).to_local()


def param_states(unit: UnitState) -> list[ParamState]:
    """The unit's parameters in flat order, then its frozen ones."""
    trained = {id(p.slot.param): p for p in unit.trained}
    states = []
    for param in [*(slot.param for slot in unit.layout.slots), *unit.layout.frozen]:
        found = trained.get(id(param))
        if found is None:
            states.append(ParamState(param, None, {}, 0))
            continue
        shape = cast(DTensor, param).to_local().shape
        moments = {key: unit.rows(found, flat).view(shape) for key, flat in unit.moments.items()}
        states.append(ParamState(param, unit.rows(found, unit.master).view(shape), moments, found.step))
    return states
