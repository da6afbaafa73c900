"""The data path of a gradient, per rank: from FSDP2's reduce-scatter to the updated 16-bit parameter shard.

1. Backward. FSDP2 reduce-scatters each unit's gradients into one flat shard as a plain sum over ranks (divide
   factor 1: the 1/world is folded into the step's scale) and calls `_on_unit_reduced` on the copy stream. Just
   before, `_compat.before_reduce` notes which of the unit's parameters got a gradient in this backward and gives
   the others a zero one, so every rank reduces the same tensors (`_on_grads_noted`). We copy
   the shard, still in the parameter dtype (2 B/param in 16-bit modes), into the unit's pinned `grad_staging`
   without blocking, record an event and hand the unit to the host worker (`_land`). With
   `accumulate_on_accelerator`, the hook instead adds each shard into an fp32 buffer on the accelerator and the
   host receives the sum once, at the window's end (or after every micro-batch, freeing the buffer in between,
   unless `retain_device_sum`).
2. Landing (`_land`, on the worker while backward goes on). Wait for the copy; add the shard into the unit's fp32
   host `grad_sum` when the window has more micro-batches (a window of one leaves it in `grad_staging`, which the
   kernel reads directly: promoting 16 to 32 bits is exact, so both give the same bits; with
   `accumulate_grad_batches=1` no `grad_sum` is allocated at all). At the window's end, take
   the unit's sum of squares and, with `overlap`, queue a speculative update (`_speculate`): the fused kernel
   runs on the unit as if the step were neither clipped nor skipped and every parameter had a gradient, writing
   the new master and moments into the unit's `spare` buffers and the 16-bit copy into `param_staging`. The
   committed state is never written. Host state exists only for the parameters the optimizer trains (`trained`):
   fp32 master and moments fp32 or bf16 (`moment_dtype`: the kernel computes in fp32 and stores them rounded).
3. Decision (`step`, after backward). The global norm of the averaged gradient (the units' sums of squares in unit
   order, all-reduced with every parameter's used-in-the-window flag) decides: skip when it is not finite, else
   one combined scale 1/world x clip factor. A parameter no rank gave a gradient in the window is not updated at
   all (as torch skips `.grad is None`): no moment decay, no weight decay, its step count unchanged.
4. Finalize (`_finalize`, per unit, in the order the next forward needs them). Skip: drop the speculation.
   Otherwise, when the speculation was computed with this very scale, hyperparameters, steps and parameters it is
   the result; else the kernel runs again from the untouched state. Commit by swapping `spare` with the state, then
   copy the updated 16-bit shards host-to-device on a side stream into FSDP2's sharded parameters. The unit's next
   forward waits for exactly that copy (`_gate`), nothing else does.
Without `overlap` the same functions run inline: landing right after backward, the update in place at the step.
The kernels, their inputs and the order of every sum are the same, so both paths give the same bits.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
from contextlib import nullcontext
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lightning_zoff import ops
from lightning_zoff._compat import all_gather_streams, before_reduce, restore_post_backward
from lightning_zoff.offload.budget import check_host_budget
from lightning_zoff.offload.buffers import host_empty
from lightning_zoff.offload.layout import ParamSlot, UnitLayout, unit_layout
from lightning_zoff.offload.worker import HostWorker
from lightning_zoff.optim.rules import GroupHyperparams, UpdateRule, update_rule_for
from lightning_zoff.optim.update import update

# Worker priorities: landings first (the step waits for every sum of squares), then finalizing (the next forward
# waits), speculation last (it only fills idle time).
_LAND, _FINALIZE, _SPECULATE = 0, 1, 2
_SWITCH_INTERVAL_S = 0.0005


@dataclass
class TrainedParam:
    """A parameter the optimizer trains: its place in the unit's flat gradient and in the unit's host state."""

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
    for param, is_used in zip(trained, used):
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
class HostUnit:
    layout: UnitLayout
    trained: list[TrainedParam]  # in flat order; the parameters outside the optimizer have no host state
    grad_spans: list[tuple[int, int]]  # runs of the flat gradient the trained parameters cover (their norm)
    master: torch.Tensor  # fp32, the trained parameters' padded rows back to back
    exp_avg: torch.Tensor  # the engine's moment_dtype: fp32 or bf16
    exp_avg_sq: torch.Tensor | None  # as exp_avg; Lion has no second moment
    spare: tuple[torch.Tensor, ...] | None  # overlap: buffers the next (master, exp_avg[, exp_avg_sq]) goes into
    # sum of this window's micro-batch gradients (a sum over ranks too); fp32 by default; None until a window of
    # several micro-batches needs it
    grad_sum: torch.Tensor | None
    grad_staging: torch.Tensor  # param dtype, pinned: lands the reduced shard (layout.flat_numel)
    param_staging: torch.Tensor  # param dtype, pinned, laid out as master: leaves for the accelerator (fp32: master)
    used: list[bool]  # per slot: it got a gradient on this rank in this window
    grad_copied: torch.cuda.Event | None = None
    params_copied: torch.cuda.Event | None = None
    staging_free: threading.Event = field(default_factory=threading.Event)  # grad_staging may be overwritten
    in_flight: bool = False  # an update is decided and not yet on its way to the accelerator
    has_grad: bool = False  # in this accumulation window
    grad_in_staging: bool = False  # the window's whole gradient is still in grad_staging
    sumsq: float | None = None  # of the window's gradient, once complete on the host
    speculation: UpdateKey | None = None  # what the state in `spare` was computed with
    device_sum: torch.Tensor | None = None  # the window's sum on the accelerator (accumulate_on_accelerator)
    host_tensors: list[torch.Tensor] = field(default_factory=list)

    def rows(self, param: TrainedParam, flat: torch.Tensor) -> torch.Tensor:
        """The parameter's unpadded rows in one of the unit's state-laid buffers (master, moments, param_staging)."""
        return flat[param.state_offset : param.state_offset + param.slot.numel]


class Traffic:
    """What the optimizer steps moved and cost on the host side since the last `take_traffic`."""

    def __init__(self) -> None:
        self.d2h_bytes = self.h2d_bytes = 0
        self.cpu_update_s = 0.0  # update kernels, speculative ones included
        self.speculations_kept = self.speculations_redone = 0
        self._lock = threading.Lock()  # the worker and the training thread both count

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)


@dataclass(frozen=True)
class StepOutcome:
    grad_norm: float  # of the averaged, unclipped gradient
    clip_coef: float  # applied to the gradient (1.0 when not clipped)
    skipped: bool  # non-finite gradient: nothing changed


@dataclass(frozen=True)
class Decision:
    skipped: bool
    scale: float
    hyper: tuple[GroupHyperparams, ...]
    used: dict[HostUnit, list[bool]]  # per trained parameter of each unit: some rank gave it a gradient


def _record_event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


class OffloadEngine:
    """Holds one rank's fp32 master shard and optimizer state and runs the update for every FSDP2 unit. `masters`
    (fp32 shards by id of the sharded parameter) is emptied as the host state takes them over."""

    def __init__(
        self,
        units: list[tuple[str, nn.Module]],
        masters: dict[int, torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        world_size: int,
        state_device: torch.device,
        pin_memory: bool,
        threads: int | None = None,
        grad_accum_dtype: torch.dtype | None = None,
        moment_dtype: torch.dtype = torch.float32,
        accumulate_grad_batches: int = 1,
        accumulate_on_accelerator: bool = False,
        retain_device_sum: bool = False,
        overlap: bool = True,
        ranks_on_node: int = 1,
    ) -> None:
        self.grad_sum_dtype = grad_accum_dtype or torch.float32
        self.moment_dtype = moment_dtype  # of exp_avg and exp_avg_sq; the master is fp32
        # windows of one micro-batch need no host sum (the kernel reads the staged shard); should the Trainer's
        # count grow later (GradientAccumulationScheduler), each unit allocates its sum when it first needs it
        self.sums_windows = accumulate_grad_batches > 1
        self.pin_memory = pin_memory
        self.accumulate_on_accelerator = accumulate_on_accelerator
        self.retain_device_sum = retain_device_sum
        self.overlap = overlap and state_device.type == "cpu"  # speculation needs the kernels' `into`
        self.window_ends = False
        self.loss_scale = 1.0
        self.traffic = Traffic()
        self.gate_wait_s = 0.0  # time forwards waited for this rank's updates (training thread only)
        self.rule = update_rule_for(optimizer)
        self.optimizer = optimizer
        self.threads = threads  # CPU threads of the kernels; None: torch.get_num_threads()
        self.world_size = world_size
        self.state_device = state_device
        group_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.units: list[HostUnit] = []
        self._modules: list[nn.Module] = []
        layouts = [(unit_layout(name, module, world_size), module) for name, module in units]
        layouts = [(layout, module) for layout, module in layouts if layout.slots or layout.frozen]
        covered = {id(p) for layout, _ in layouts for p in [*(s.param for s in layout.slots), *layout.frozen]}
        missing = set(group_of) - covered
        if missing:
            raise ValueError(
                f"{len(missing)} parameter(s) of the optimizer are not parameters of the sharded model; zoff can"
                " only optimize the LightningModule's own parameters, passed after sharding (configure_optimizers)."
            )
        some_param = next((p for layout, _ in layouts for p in [*(s.param for s in layout.slots), *layout.frozen]), None)
        self.param_device = some_param.device if some_param is not None else state_device
        trained = sum(s.padded_numel for layout, _ in layouts for s in layout.slots if id(s.param) in group_of)
        reduced = sum(layout.flat_numel for layout, _ in layouts)
        if state_device.type == "cpu" and trained:
            untrained = sum(p.to_local().numel() for layout, _ in layouts
                            for p in [*(s.param for s in layout.slots if id(s.param) not in group_of), *layout.frozen])
            check_host_budget(
                trained, ranks_on_node, reduced=reduced, untrained=untrained,
                param_bytes=some_param.element_size(), second_moment=self.rule is not UpdateRule.LION,
                overlap=self.overlap, accum_bytes=self.grad_sum_dtype.itemsize if self.sums_windows else 0,
                moment_bytes=moment_dtype.itemsize,
            )
        if moment_dtype == torch.bfloat16:
            _warn_if_bf16_moments_cannot_decay(self.rule, optimizer)
        for layout, module in layouts:
            self.units.append(self._host_unit(layout, masters, group_of, pin_memory))
            self._modules.append(module)
        on_cuda = self.param_device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.param_device) if on_cuda else None  # D2H, FSDP2's hook runs here
        self.h2d_stream = torch.cuda.Stream(self.param_device) if on_cuda else None
        self.worker = HostWorker() if self.overlap else None
        self._switch_interval = sys.getswitchinterval()  # what `close` restores
        self._gate_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._closed = False
        if self.worker is not None:
            # The worker needs the GIL for a moment between kernels; by default Python hands it over only every
            # 5 ms, and a unit's landing and update are several calls. Hand it over 10x sooner.
            sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL_S))
        self._window = 0  # accumulation windows decided so far
        self._landings = 0  # landings handed to the worker and not yet done
        self._landings_lock = threading.Lock()  # counted up in backward's thread, down in the worker
        self._landed_order: list[HostUnit] = []  # this backward's units, in the order their gradients arrived
        self.speculations = {"kept": 0, "redone": 0}  # since the start, for tests and logs
        self.await_speculation = False  # decide only after every speculation ran: makes tests cover keep and redo

    def _host_unit(
        self, layout: UnitLayout, masters: dict[int, torch.Tensor], group_of: dict[int, int], pin: bool
    ) -> HostUnit:
        """Host state for the unit's trained parameters only: frozen ones and those outside the optimizer are never
        updated, so their value lives on the accelerator alone (the fp32 copies `shard_model` cut are dropped)."""
        dev = self.state_device
        trained, state_numel = [], 0
        for index, slot in enumerate(layout.slots):
            group = group_of.get(id(slot.param))
            if group is not None:
                trained.append(TrainedParam(slot, index, state_numel, group))
                state_numel += slot.padded_numel
        moments = 1 if self.rule is UpdateRule.LION else 2
        state = [torch.zeros(state_numel, dtype=dtype, device=dev)
                 for dtype in [torch.float32] + [self.moment_dtype] * moments]
        for param in trained:  # consumed: the model's fp32 copies are freed as the host state fills
            param_rows = state[0][param.state_offset : param.state_offset + param.slot.numel]
            param_rows.copy_(masters.pop(id(param.slot.param)).reshape(-1))
        for p in [*(s.param for s in layout.slots), *layout.frozen]:
            masters.pop(id(p), None)
        # the spare starts as a copy, so the rows no update writes (padding) agree in both
        spare = tuple(t.clone() for t in state) if self.overlap else None
        n = layout.flat_numel
        grad_sum = self._new_grad_sum(n) if self.sums_windows else None
        spans: list[tuple[int, int]] = []
        for param in trained:
            start, end = param.slot.offset, param.slot.offset + param.slot.padded_numel
            if spans and spans[-1][1] == start:
                spans[-1] = (spans[-1][0], end)
            else:
                spans.append((start, end))
        param_dtype = (layout.slots[0].param if layout.slots else layout.frozen[0]).dtype
        grad_staging = host_empty(n, param_dtype, dev, pin)
        if param_dtype == torch.float32:
            param_staging = state[0]  # fp32 shards (32-true) go back straight from the master
        else:
            param_staging = host_empty(state_numel, param_dtype, dev, pin)
            param_staging.copy_(state[0])
        tensors = [*state, *(spare or ()), *(() if grad_sum is None else (grad_sum,)), grad_staging]
        tensors += [] if param_staging is state[0] else [param_staging]
        unit = HostUnit(layout, trained, spans, state[0], state[1], state[2] if len(state) == 3 else None, spare,
                        grad_sum, grad_staging, param_staging, [False] * len(layout.slots), host_tensors=tensors)
        unit.staging_free.set()
        return unit

    def _new_grad_sum(self, numel: int) -> torch.Tensor:
        return host_empty(numel, self.grad_sum_dtype, self.state_device, self.pin_memory).zero_()

    def _grad_sum(self, unit: HostUnit) -> torch.Tensor:
        """The unit's window sum, allocated when a window of several micro-batches first needs it."""
        if unit.grad_sum is None:
            unit.grad_sum = self._new_grad_sum(unit.layout.flat_numel)
            unit.host_tensors.append(unit.grad_sum)
        return unit.grad_sum

    def _state(self, unit: HostUnit) -> tuple[torch.Tensor, ...]:
        return (unit.master, unit.exp_avg) if unit.exp_avg_sq is None else (unit.master, unit.exp_avg, unit.exp_avg_sq)

    # -- backward -------------------------------------------------------------------------------------------

    def attach(self) -> None:
        """Register the reduce hook on every unit (FSDP2 then sums, not averages, gradients over ranks) and the gate
        that holds each unit's forward until its update is on the accelerator. Units without a parameter that
        requires a gradient need neither."""
        for unit, module in zip(self.units, self._modules):
            if not unit.layout.slots:
                continue
            before_reduce(module, lambda used, unit=unit: self._on_grads_noted(unit, used))
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no AVG; the 1/world goes into the step
            module.set_all_reduce_hook(lambda flat, unit=unit: self._on_unit_reduced(unit, flat), stream=self.copy_stream)
            # prepend: before FSDP2's own pre-forward, whose all-gather reads the sharded parameters
            self._gate_hooks.append(module.register_forward_pre_hook(
                lambda *_, unit=unit, module=module: self._gate(unit, module), prepend=True))

    def begin_backward(self, window_ends: bool, loss_scale: float = 1.0) -> None:
        """Called before each backward; `window_ends`: it is the window's last (Lightning steps right after)."""
        self.window_ends = window_ends
        self.loss_scale = loss_scale
        self._landed_order = []

    @staticmethod
    def _on_grads_noted(unit: HostUnit, used: list[bool]) -> None:
        # FSDP2 is about to reduce the unit: which of its parameters got a gradient on this rank (the others get zeros)
        if len(used) != len(unit.used):
            raise RuntimeError(
                f"zoff: unit {unit.layout.name!r} has {len(used)} parameters that require a gradient, {len(unit.used)}"
                " when fit started. Set requires_grad before trainer.fit; zoff fixes what it trains for each fit."
            )
        unit.used = [a or b for a, b in zip(unit.used, used)]

    def _on_unit_reduced(self, unit: HostUnit, flat_grad: torch.Tensor) -> None:
        # Runs inside FSDP2's backward, on the copy stream; FSDP2's later use of `flat_grad` is on this stream too.
        if flat_grad.numel() != unit.layout.flat_numel:
            raise RuntimeError(
                f"zoff: unit {unit.layout.name!r} reduced {flat_grad.numel()} gradient elements, expected"
                f" {unit.layout.flat_numel}; this torch version lays out FSDP2 shards differently."
            )
        unit.staging_free.wait()  # the worker still reads the previous micro-batch's shard (rare: it keeps up)
        unit.staging_free.clear()
        window_ends = self.window_ends
        if not self.accumulate_on_accelerator or (window_ends and not unit.has_grad):
            # host accumulation, or a window of one micro-batch: the 16-bit shard goes down as it is
            unit.grad_staging.copy_(flat_grad, non_blocking=True)
            self.traffic.add(d2h_bytes=unit.grad_staging.nbytes)
        else:
            self._accumulate_on_accelerator(unit, flat_grad, window_ends)
        unit.grad_copied = _record_event(self.copy_stream)
        self._landed_order.append(unit)
        if self.worker is not None:
            with self._landings_lock:
                self._landings += 1
            event = unit.grad_copied
            self.worker.submit(_LAND, lambda: self._land(unit, window_ends),
                               ready=None if event is None else event.query)

    def _accumulate_on_accelerator(self, unit: HostUnit, flat_grad: torch.Tensor, window_ends: bool) -> None:
        # The window's sum lives in an accelerator buffer; the host sees it once, at the window's end. Unless
        # retained, the buffer goes down to the host after every micro-batch and comes back (exactly) for the next.
        grad_sum = self._grad_sum(unit)
        if unit.device_sum is None and unit.has_grad:
            unit.device_sum = grad_sum.to(self.param_device, non_blocking=True, copy=True)
            self.traffic.add(h2d_bytes=grad_sum.nbytes)
        if unit.device_sum is None:
            unit.device_sum = flat_grad.to(grad_sum.dtype, copy=True)
        else:
            unit.device_sum.add_(flat_grad)
        if window_ends or not self.retain_device_sum:
            grad_sum.copy_(unit.device_sum, non_blocking=True)
            self.traffic.add(d2h_bytes=grad_sum.nbytes)

    @torch.no_grad()
    def after_backward(self) -> None:
        """Free the accelerator's gradients (the copies are ordered before any reuse of their memory by FSDP2's
        end of backward); without overlap, land every unit now."""
        if self.worker is None:
            for unit in self._landed_order:
                self._land(unit, self.window_ends)
        for unit in self.units:
            for slot in unit.layout.slots:
                slot.param.grad = None

    @torch.no_grad()
    def _land(self, unit: HostUnit, window_ends: bool) -> None:
        """Fold the arrived shard into the window's sum; at the window's end take its sum of squares."""
        try:
            if unit.grad_copied is not None:
                unit.grad_copied.synchronize()
            if self.accumulate_on_accelerator and unit.device_sum is not None:
                if window_ends or not self.retain_device_sum:
                    unit.device_sum = None  # the host holds the sum now
            elif unit.has_grad:
                if unit.grad_in_staging:  # the staged gradient was just overwritten: refuse, never guess
                    raise RuntimeError("zoff: a second backward ran after the window's last one, before the step")
                self._accumulate(self._grad_sum(unit), unit.grad_staging)
            elif window_ends:
                unit.grad_in_staging = True
            else:
                self._accumulate(self._grad_sum(unit), unit.grad_staging, replace=True)
            unit.has_grad = True
            if window_ends:
                unit.sumsq = self._unit_sumsq(unit)
                if self.worker is not None:
                    window, scale = self._window, 1.0 / (self.world_size * self.loss_scale)
                    self.worker.submit(_SPECULATE, lambda: self._speculate(unit, window, scale))
        finally:
            if not unit.grad_in_staging:
                unit.staging_free.set()
            if self.worker is not None:
                with self._landings_lock:
                    self._landings -= 1
                self.worker.notify()

    def _accumulate(self, total: torch.Tensor, shard: torch.Tensor, replace: bool = False) -> None:
        # the kernel, not torch, on the host: it runs on this rank's optimizer threads (torch's pool is small there)
        if total.device.type == "cpu":
            ops.accumulate(total, shard, replace=replace, threads=self.threads)
        elif replace:
            total.copy_(shard)
        else:
            total.add_(shard)

    @staticmethod
    def _window_grad(unit: HostUnit) -> torch.Tensor:
        if unit.grad_in_staging:
            return unit.grad_staging
        assert unit.grad_sum is not None  # a window's gradient is in one of the two
        return unit.grad_sum

    def _unit_sumsq(self, unit: HostUnit) -> float:
        """Of the trained parameters' gradient only: clipping, like Lightning's, takes the optimizer's parameters."""
        grad = self._window_grad(unit)
        total = 0.0
        for start, end in unit.grad_spans:
            if grad.device.type == "cpu":
                total += ops.grad_sumsq_finite(grad[start:end], threads=self.threads)[0]
            else:
                total += torch.linalg.vector_norm(grad[start:end], dtype=torch.float32).double().item() ** 2
        return total

    # -- step -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, max_norm: float | None, loss_scale: float = 1.0) -> StepOutcome:
        """Decide this window's step (every rank reaches the same decision) and finalize every unit that received
        a gradient in it; with `overlap` the finalizing runs on the worker and this returns at once.

        The host gradients are sums over ranks of the loss-scaled gradients: the true norm divides by both."""
        if self.worker is not None:
            self.worker.wait_until(lambda: self._landings == 0)
            if self.await_speculation:
                self.worker.wait_idle()
        units = [u for u in self.units if u.has_grad]
        sq = torch.zeros((), dtype=torch.float64)
        for unit in units:  # in unit order on every path, so the sum has the same bits
            if unit.sumsq is None:  # a unit whose gradient came only in earlier micro-batches
                unit.sumsq = self._unit_sumsq(unit)
            sq += unit.sumsq
        # with the sum of squares, every trained parameter's "got a gradient here" flag: summed, "on some rank"
        flags = [float(unit.used[p.slot_index]) for unit in units for p in unit.trained]
        reduced = torch.tensor([sq.item(), *flags], dtype=torch.float64)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(reduced)  # a CPU tensor: gloo, also under "cpu:gloo,cuda:nccl"
        global_flags = iter((reduced[1:] > 0).tolist())
        used = {unit: [next(global_flags) for _ in unit.trained] for unit in units}
        for unit in units:
            unit.used = [False] * len(unit.used)
        norm = math.sqrt(reduced[0].item()) / (self.world_size * loss_scale)
        skipped = not math.isfinite(norm)  # inf or NaN anywhere (fp16 overflow included): change nothing
        clip_coef = 1.0
        if not skipped and max_norm is not None and max_norm > 0:
            clip_coef = min(1.0, max_norm / (norm + 1e-6))
        decision = Decision(skipped, clip_coef / (self.world_size * loss_scale),
                            tuple(GroupHyperparams.of(g) for g in optimizer.param_groups), used)
        self._window += 1  # speculations of this window are now stale
        order = self._landed_order[::-1] + [u for u in units if u not in self._landed_order]
        if not skipped:  # counted here, so each step reports its own copies even when they end during the next
            self.traffic.add(h2d_bytes=sum(p.slot.local.nbytes for unit in units
                                           for p, is_used in zip(unit.trained, used[unit]) if is_used))
        for unit in order:  # the next forward needs them about in the reverse of backward's order
            if unit.has_grad:
                unit.in_flight = True
                if self.worker is not None:
                    self.worker.submit(_FINALIZE, lambda unit=unit: self._finalize(unit, decision))
                else:
                    self._finalize(unit, decision)
        return StepOutcome(norm, clip_coef, skipped)

    @staticmethod
    def _key(unit: HostUnit, scale: float, hyper: tuple[GroupHyperparams, ...], used: list[bool]) -> UpdateKey:
        runs = kernel_runs(unit.trained, used)
        return UpdateKey(scale, runs, tuple(hyper[run.group_index] for run in runs))

    @torch.no_grad()
    def _speculate(self, unit: HostUnit, window: int, scale: float) -> None:
        if window != self._window or not unit.has_grad:
            return  # decided already: finalizing does the exact work
        hyper = tuple(GroupHyperparams.of(g) for g in self.optimizer.param_groups)
        key = self._key(unit, scale, hyper, [True] * len(unit.trained))  # as if every parameter had a gradient
        self._update(unit, key)
        unit.speculation = key

    @torch.no_grad()
    def _finalize(self, unit: HostUnit, decision: Decision) -> None:
        try:
            if not decision.skipped:
                key = self._key(unit, decision.scale, decision.hyper, decision.used[unit])
                if unit.speculation == key:
                    self.traffic.add(speculations_kept=1)
                    self.speculations["kept"] += 1
                else:
                    if unit.speculation is not None:
                        self.traffic.add(speculations_redone=1)
                        self.speculations["redone"] += 1
                    self._update(unit, key)
                self._commit(unit, decision.used[unit])
        finally:
            unit.speculation, unit.sumsq = None, None
            unit.has_grad = unit.grad_in_staging = False
            unit.staging_free.set()
            unit.in_flight = False

    def _update(self, unit: HostUnit, key: UpdateKey) -> None:
        """Run the kernel over every run of the key: into `spare` with overlap, in place without."""
        if unit.params_copied is not None:
            unit.params_copied.synchronize()  # param_staging still feeds the last step's copy
        grad, state = self._window_grad(unit), self._state(unit)
        start = time.perf_counter()
        for run, hyper in zip(key.runs, key.hyper):
            s, e, g = run.state_start, run.state_start + run.numel, slice(run.grad_start, run.grad_start + run.numel)
            into = None if unit.spare is None else tuple(t[s:e] for t in unit.spare)
            update(self.rule, hyper, run.step, state[0][s:e], grad[g], state[1][s:e],
                   None if len(state) == 2 else state[2][s:e], grad_scale=key.scale,
                   out=None if unit.param_staging is unit.master else unit.param_staging[s:e], into=into,
                   threads=self.threads)
        self.traffic.add(cpu_update_s=time.perf_counter() - start)

    def _commit(self, unit: HostUnit, used: list[bool]) -> None:
        """Make the update the state, then send the updated 16-bit shards to the accelerator."""
        updated = [p for p, is_used in zip(unit.trained, used) if is_used]
        for param in updated:
            param.step += 1
        if unit.spare is not None:
            for param, is_used in zip(unit.trained, used):  # what this update did not write keeps its value
                if not is_used:
                    s, e = param.state_offset, param.state_offset + param.slot.padded_numel
                    for new, old in zip(unit.spare, self._state(unit)):
                        new[s:e].copy_(old[s:e])
            fp32_params = unit.param_staging is unit.master
            old = self._state(unit)
            unit.master, unit.exp_avg = unit.spare[0], unit.spare[1]
            unit.exp_avg_sq = unit.spare[2] if len(unit.spare) == 3 else None
            unit.spare = old
            if fp32_params:
                unit.param_staging = unit.master
        self._send(unit, updated, non_blocking=True)

    def _send(self, unit: HostUnit, params: list[TrainedParam], non_blocking: bool) -> None:
        """Copy the parameters' 16-bit rows from `param_staging` into FSDP2's sharded parameters."""
        stream = self.h2d_stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for param in params:
                local = param.slot.local
                local.copy_(unit.rows(param, unit.param_staging).view_as(local), non_blocking=non_blocking)
        unit.params_copied = _record_event(stream)

    def _gate(self, unit: HostUnit, module: nn.Module) -> None:
        """Before a unit's forward: wait until its update is decided and on its way, then order FSDP2's all-gather
        of its shards after that copy."""
        if unit.in_flight:
            start = time.perf_counter()
            self.worker.wait_until(lambda: not unit.in_flight)
            self.gate_wait_s += time.perf_counter() - start
        event = unit.params_copied
        if event is not None:
            torch.cuda.current_stream(self.param_device).wait_event(event)
            streams = all_gather_streams(module)
            if streams is None:
                event.synchronize()  # a torch whose FSDP2 keeps them elsewhere: wait on the host, always safe
            else:
                for stream in streams:
                    stream.wait_event(event)

    def wait_idle(self) -> None:
        """Block until no update is in flight: the host state and the accelerator's shards are this step's."""
        if self.worker is not None:
            self.worker.wait_idle()
        for unit in self.units:
            if unit.params_copied is not None:
                unit.params_copied.synchronize()

    @torch.no_grad()
    def send_masters(self) -> None:
        """Make every trained shard on the accelerator the cast of its master again (after the masters were loaded)."""
        self.wait_idle()
        for unit in self.units:
            if unit.param_staging is not unit.master:
                unit.param_staging.copy_(unit.master)
            self._send(unit, unit.trained, non_blocking=False)

    def take_traffic(self) -> Traffic:
        traffic, self.traffic = self.traffic, Traffic()
        return traffic

    def take_gate_wait(self) -> float:
        seconds, self.gate_wait_s = self.gate_wait_s, 0.0
        return seconds

    # -- accounting -----------------------------------------------------------------------------------------

    def memory_report(self) -> dict[str, float]:
        """Bytes this rank holds, by kind, and per parameter element of its shard (and per trained element: only the
        parameters the optimizer trains have host state)."""
        locals_ = [p.to_local() for u in self.units for p in [*(s.param for s in u.layout.slots), *u.layout.frozen]]
        local_numel = sum(t.numel() for t in locals_)
        accel_params = sum(t.numel() * t.element_size() for t in locals_)
        trained_numel = sum(p.slot.numel for u in self.units for p in u.trained)
        host = {
            "host_master": sum(u.master.nbytes for u in self.units),
            "host_optimizer_state": sum(t.nbytes for u in self.units for t in (u.exp_avg, u.exp_avg_sq) if t is not None),
            "host_spare_state": sum(t.nbytes for u in self.units for t in (u.spare or ())),
            "host_grad_sum": sum(u.grad_sum.nbytes for u in self.units if u.grad_sum is not None),
            "host_staging": sum(u.grad_staging.nbytes + (0 if u.param_staging is u.master else u.param_staging.nbytes)
                                for u in self.units),
        }
        host_total = sum(host.values())
        sum_bytes = [u.layout.flat_numel * self.grad_sum_dtype.itemsize for u in self.units]
        if not (self.accumulate_on_accelerator and self.sums_windows):
            accel_sum = 0
        elif self.retain_device_sum:
            accel_sum = sum(sum_bytes)  # every unit's buffer for the whole window
        else:
            accel_sum = max(sum_bytes, default=0)  # one unit's, while its backward runs
        return {
            "local_params": local_numel,
            "trained_params": trained_numel,
            "accelerator_params": accel_params,
            # the largest unit's reduced gradient lives on the accelerator only until it reaches the host
            "accelerator_grad_peak": max((u.layout.flat_numel * u.grad_staging.element_size() for u in self.units), default=0),
            "accelerator_grad_sum": accel_sum,
            **host,
            "host_total": host_total,
            "accelerator_bytes_per_param": accel_params / max(local_numel, 1),
            "host_bytes_per_param": host_total / max(local_numel, 1),
            "host_bytes_per_trained_param": host_total / max(trained_numel, 1),
        }

    # -- lifetime -------------------------------------------------------------------------------------------

    def fp32_shards(self) -> dict[int, torch.Tensor]:
        """Copies of this rank's fp32 master rows of every sharded parameter of the units, by id of the parameter:
        the `masters` an engine for a later optimizer over the same units starts from."""
        self.wait_idle()
        shards = {}
        for unit in self.units:
            trained = {id(p.slot.param): p for p in unit.trained}
            for param in [*(slot.param for slot in unit.layout.slots), *unit.layout.frozen]:
                local = param.to_local()
                if id(param) in trained:  # its master; the others have only their value on the accelerator
                    shards[id(param)] = unit.rows(trained[id(param)], unit.master).view(local.shape).clone()
                else:
                    shards[id(param)] = local.detach().to(self.state_device, torch.float32, copy=True)
        return shards

    def close(self) -> None:
        """Retire the engine: wait for its work, remove its forward gates, end its worker, restore the switch
        interval and let go of its host buffers. FSDP2's reduce hooks cannot be removed; they are pointed at one that
        refuses (and holds no buffer) until the next engine's `attach` replaces them. Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_idle()
        finally:
            for hook in self._gate_hooks:
                hook.remove()
            self._gate_hooks.clear()
            for module in self._modules:
                module.set_all_reduce_hook(_refuse_backward)
                restore_post_backward(module)
            if self.worker is not None:
                self.worker.close()
                sys.setswitchinterval(self._switch_interval)
            self.units, self._modules, self._landed_order = [], [], []


def _refuse_backward(flat_grad: torch.Tensor) -> None:
    raise RuntimeError("zoff: a backward reached a closed OffloadEngine; the strategy builds a new one for each fit.")


def _warn_if_bf16_moments_cannot_decay(rule: UpdateRule, optimizer: torch.optim.Optimizer) -> None:
    # Rounding to nearest gives a bf16 moment back unchanged unless the step moves it by half a bf16 ulp, 2^-9 to 2^-8
    # of its value. Decaying, a step moves it by at most (1 - beta) of its value: with 1 - beta below 2^-8 the decay
    # can round away, below 2^-9 (beta2 = 0.999) it always does, and the moment only ever grows.
    decays = [("beta2", 1, "exp_avg")] if rule is UpdateRule.LION else [("beta1", 0, "exp_avg"), ("beta2", 1, "exp_avg_sq")]
    slow = sorted({f"{name}={float(group['betas'][i]):g} ({moment})" for group in optimizer.param_groups
                   for name, i, moment in decays if 1 - float(group["betas"][i]) < 2**-8})
    if slow:
        warnings.warn(
            f"zoff: optimizer_state_dtype='bf16' with {', '.join(slow)}: a step decays such a moment by less than half"
            " a bf16 ulp, so rounding to nearest can keep its old value (at 0.999 it never shrinks, it only grows)."
            " Use betas of at most 0.996 (0.95 is common for beta2) or optimizer_state_dtype='fp32'.",
            stacklevel=3,
        )


def describe_memory(report: dict[str, float]) -> str:
    """One line: sizes in MiB, ratios in bytes per parameter element."""
    parts = []
    for key, value in report.items():
        if key in ("local_params", "trained_params"):
            parts.append(f"{key}={int(value):,}")
        elif "_per_" in key:
            parts.append(f"{key}={value:.2f}")
        else:
            parts.append(f"{key}={value / 2**20:.1f} MiB")
    return ", ".join(parts)
