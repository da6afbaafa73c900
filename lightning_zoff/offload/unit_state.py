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

from lightning_zoff.offload.layout import ParamSlot, UnitLayout
from lightning_zoff.optim.rules import GroupHyperparams
from lightning_zoff.placement import Placement
from lightning_zoff.placement.host_buffers import host_empty
from lightning_zoff.placement.mover import SpareSet, make_buffers
from lightning_zoff.placement.staging_ring import Slot

__all__ = ["ParamState", "Phase", "Run", "TrainedParam", "UnitState", "UpdateKey", "build_unit_state", "kernel_runs",
           "param_states"]


class Phase(enum.Enum):
    """A unit's place in the accumulation window: EMPTY -> SUMMING* -> READY -> FINALIZING -> EMPTY."""

    EMPTY = "no gradient in this window yet"
    SUMMING = "part of the window's gradient is in the sum, more micro-batches may add to it"
    READY = "the window's whole gradient is in `window_grad` (or the shards: `grad_in_shards`) with its sum of squares"
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
    """Buffers as `placement.plan.unit_buffers` sizes them for the unit's placement (`placement.mover.make_buffers`
    makes them, and `relocate` anew when the unit moves).

    Threads: with `overlap`, a host unit is written by the training thread and by the worker, never at once; each
    phase says who may write it and a wait hands it over:
    - EMPTY and SUMMING, in backward: the training thread writes `used`, `device_sum`, `grad_copied` and
      the contents of `grad_staging` (after `staging_free`: the worker is done reading it); the worker's landing then
      writes `phase`, `window_grad`, `grad_sum`, `sumsq` and sets `staging_free`.
    - READY: the worker's speculation writes `spare` and `speculation` (no other field).
    - The step (`engine.step`) waits for every landing, then the training thread writes `sumsq` of SUMMING units,
      `used` and `phase` = FINALIZING.
    - FINALIZING: the worker alone writes `state`, `spare`, `speculation`, `window_grad`, `sumsq`, `param_staging`,
      `params_copied` and the steps of `trained`, and ends with `phase` = EMPTY; the unit's next forward (`gate`)
      waits for that before it reads `params_copied`.
    Without overlap, or on the accelerator, the training thread does all of it.
    """

    layout: UnitLayout
    placement: Placement
    param_dtype: torch.dtype  # of the model's shards (the gradient FSDP2 reduces has it too)
    trained: list[TrainedParam]  # in flat order
    grad_spans: list[tuple[int, int]]  # runs of the flat gradient the trained parameters cover (their norm)
    state: list[torch.Tensor]  # [master fp32, exp_avg, exp_avg_sq]; Lion has no exp_avg_sq; moments fp32 or bf16
    spare: SpareSet | None  # a speculation's buffers, lent by the SparePool until the step is decided
    # sum of this window's micro-batch gradients (a sum over ranks too); fp32 by default; None until a window of
    # several micro-batches needs it
    grad_sum: torch.Tensor | None
    # on the host: the pinned buffer the reduced shard lands in (layout.flat_numel); None on the accelerator, where
    # the reduced shard goes over the shards or into the window's sum as it arrives
    grad_staging: torch.Tensor | None
    # on the host: where the updated 16-bit parameters leave from, laid out as the master: `grad_staging` itself when
    # the layouts agree (the kernel overwrites each gradient element with its parameter), else a pinned buffer of its
    # own, or the master for fp32 models; None on the accelerator, whose update writes FSDP2's shards directly
    param_staging: torch.Tensor | None
    used: list[bool]  # per slot: it got a gradient on this rank in this window
    # a host unit whose landing and out buffers are slots of the shared staging ring (`placement/staging_ring.py`),
    # taken for one landing or one update: `grad_staging` and `param_staging` are those slots while they are held
    in_ring: bool = False
    staging_slot: Slot | None = None  # the ring's slot `grad_staging` or `param_staging` is, while held
    phase: Phase = Phase.EMPTY
    window_grad: torch.Tensor | None = None  # grad_staging or grad_sum; None while EMPTY (and `grad_in_shards`)
    # on the accelerator, a window of one micro-batch: its gradient was written over FSDP2's shards of the trained
    # parameters (each shard is only the cast of its master until the step, which casts it again), so the accelerator
    # holds no gradient of its own units until the step
    grad_in_shards: bool = False
    sumsq: float | None = None  # of the window's gradient, once READY
    speculation: UpdateKey | None = None  # what the state in `spare` was computed with
    device_sum: torch.Tensor | None = None  # the window's sum on the accelerator (accumulate_on_accelerator)
    grad_copied: torch.cuda.Event | None = None
    params_copied: torch.cuda.Event | None = None
    state_back: torch.cuda.Event | None = None  # the accelerator ran its last update: master and moments are back then
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
    def same_layout(self) -> bool:
        """The state is laid out as the flat gradient: every reduced parameter is trained."""
        return len(self.trained) == len(self.layout.slots)

    @property
    def at_rest(self) -> bool:
        """Between windows with nothing in flight (no speculation or spare set): the state may move."""
        return self.phase is Phase.EMPTY and self.speculation is None and self.spare is None

    @property
    def fp32_params(self) -> bool:
        """The parameters are fp32 (32-true): they go back to the accelerator straight from the master."""
        return self.param_dtype == torch.float32

    def rows(self, param: TrainedParam, flat: torch.Tensor) -> torch.Tensor:
        """The parameter's unpadded rows in one of the unit's state-laid buffers (master, moments, param_staging)."""
        return flat[param.state_offset : param.state_offset + param.slot.numel]

    def swap_spare(self) -> SpareSet:
        """Make the spare state (a kept speculation) the unit's; returns the old state with the spare's 16-bit copy,
        which still feeds this step's copy to the accelerator: the pool's next set."""
        assert self.spare is not None
        spare, self.spare = self.spare, None
        old, self.state = self.state, spare.state
        if self.fp32_params:
            self.param_staging = self.master
        return SpareSet(old, spare.out, spare.sent)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the unit allocated for the optimizer (what its memory is; a lent spare set is the pool's)."""
        tensors = [*self.state]
        tensors += [t for t in (self.grad_staging, self.grad_sum) if t is not None]
        if self.param_staging is not None and not self._out_is_shared():
            tensors.append(self.param_staging)
        return tensors

    def _out_is_shared(self) -> bool:
        assert self.param_staging is not None
        return self.fp32_params or (self.grad_staging is not None
                                    and self.param_staging.data_ptr() == self.grad_staging.data_ptr())


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
    pin_state: bool = False,
    landing_ring: bool = False,
) -> UnitState:
    """State for the unit's trained parameters on `device`, their rows taken from `masters` (fp32 shards by id of
    the sharded parameter), which are consumed: the model's fp32 copies are freed as the state fills. `pin`: the
    staging buffers pinned; `pin_state`: the master and moments too (they cross PCIe when the accelerator updates the
    unit: `lending.py`)."""
    trained, state_numel = [], 0
    for index, slot in enumerate(layout.slots):
        group = group_of.get(id(slot.param))
        if group is not None:
            trained.append(TrainedParam(slot, index, state_numel, group))
            state_numel += slot.padded_numel
    state = [host_empty(state_numel, dtype, device, pin=pin_state).zero_()
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
    unit = UnitState(layout, placement, param_dtype, trained, spans, state, spare=None, grad_sum=None,
                     grad_staging=None, param_staging=None, used=[False] * len(layout.slots))
    make_buffers(unit, device, sums_windows=sums_windows, grad_sum_dtype=grad_sum_dtype, pin=pin,
                 landing_ring=landing_ring)
    unit.staging_free.set()
    return unit


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
