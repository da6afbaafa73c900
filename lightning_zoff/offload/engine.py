"""The data path of a gradient, per rank: from FSDP2's reduce-scatter to the updated 16-bit parameter shard.

1. Backward. FSDP2 reduce-scatters each unit's gradients into one flat shard as a plain sum over ranks (divide
   factor 1: the 1/world is folded into the step's scale) and calls `_on_unit_reduced` on the copy stream. We copy
   the shard, still in the parameter dtype (2 B/param in 16-bit modes), into the unit's pinned `grad_staging`
   without blocking, and record an event.
2. End of each backward (`after_backward`). Wait for those copies and drop FSDP2's `.grad` views, so no
   gradient stays on the accelerator between micro-batches. When more micro-batches follow, add the shard into
   the unit's fp32 host `grad_sum`; a window of one micro-batch leaves it in `grad_staging`, which the kernel
   reads directly (promoting 16 to 32 bits is exact, so both give the same bits). With
   `accumulate_on_accelerator`, the hook instead adds each shard into an fp32 buffer on the accelerator and
   the host receives the sum once, at the window's end (or after every micro-batch, freeing the buffer in
   between, unless `retain_device_sum`). The sums are the same adds in the same order: the same bits.
3. Step (`step`). The global norm of the averaged gradient (per-rank sum of squares, all-reduced) decides:
   skip when it is not finite, else one combined scale 1/world x clip factor goes into the kernel. One fused
   pass per run of parameters reads the gradient, updates the fp32 master and moments and writes the 16-bit
   copy into the pinned `param_staging`, which goes host-to-device into FSDP2's sharded parameters, where the
   next all-gather reads it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lightning_zoff import ops
from lightning_zoff.offload.buffers import host_empty
from lightning_zoff.offload.layout import ParamSlot, UnitLayout, unit_layout
from lightning_zoff.optim.rules import GroupHyperparams, UpdateRule, update_rule_for
from lightning_zoff.optim.update import update


@dataclass
class Segment:
    """A contiguous run of one unit's flat shard whose parameters share a param group."""

    group_index: int
    start: int
    end: int
    step: int = 0  # optimizer steps taken (torch keeps this per parameter; a segment steps as one)


@dataclass
class HostUnit:
    layout: UnitLayout
    segments: list[Segment]
    updated_slots: list[ParamSlot]  # the slots in some segment: only they change and go back to the accelerator
    master: torch.Tensor  # fp32
    exp_avg: torch.Tensor  # fp32
    exp_avg_sq: torch.Tensor | None  # fp32; Lion has no second moment
    grad_sum: torch.Tensor  # sum of this window's micro-batch gradients (a sum over ranks too); fp32 by default
    grad_staging: torch.Tensor  # param dtype, pinned: lands the reduced shard
    param_staging: torch.Tensor  # param dtype, pinned: leaves for the accelerator
    grad_copied: torch.cuda.Event | None = None
    params_copied: torch.cuda.Event | None = None
    grad_arrived: bool = False  # in this backward
    has_grad: bool = False  # in this accumulation window
    grad_in_staging: bool = False  # the window's whole gradient is still in grad_staging
    device_sum: torch.Tensor | None = None  # the window's sum on the accelerator (accumulate_on_accelerator)
    host_tensors: list[torch.Tensor] = field(default_factory=list)


@dataclass
class Traffic:
    """What one optimizer step moved and cost on the host side (summed over its window)."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    cpu_update_s: float = 0.0


@dataclass(frozen=True)
class StepOutcome:
    grad_norm: float  # of the averaged, unclipped gradient
    clip_coef: float  # applied to the gradient (1.0 when not clipped)
    skipped: bool  # non-finite gradient: nothing changed


def _record_event(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class OffloadEngine:
    """Holds one rank's fp32 master shard and optimizer state and runs the update for every FSDP2 unit."""

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
        accumulate_on_accelerator: bool = False,
        retain_device_sum: bool = False,
    ) -> None:
        self.grad_accum_dtype = grad_accum_dtype  # None: fp32
        self.accumulate_on_accelerator = accumulate_on_accelerator
        self.retain_device_sum = retain_device_sum
        self.window_ends = False
        self.traffic = Traffic()
        self.rule = update_rule_for(optimizer)
        self.threads = threads  # CPU threads of the kernels; None: torch.get_num_threads()
        self.world_size = world_size
        self.state_device = state_device
        group_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.units: list[HostUnit] = []
        self._modules: list[nn.Module] = []
        covered: set[int] = set()
        for name, module in units:
            layout = unit_layout(name, module, world_size)
            if not layout.slots:
                continue
            covered.update(id(s.param) for s in layout.slots)
            self.units.append(self._host_unit(layout, masters, group_of, pin_memory))
            self._modules.append(module)
        missing = set(group_of) - covered
        if missing:
            raise ValueError(
                f"{len(missing)} parameter(s) of the optimizer are not parameters of the sharded model; zoff can"
                " only optimize the LightningModule's own parameters, passed after sharding (configure_optimizers)."
            )
        self.param_device = self.units[0].layout.slots[0].local.device if self.units else state_device
        self.copy_stream = torch.cuda.Stream(self.param_device) if self.param_device.type == "cuda" else None

    def _host_unit(
        self, layout: UnitLayout, masters: dict[int, torch.Tensor], group_of: dict[int, int], pin: bool
    ) -> HostUnit:
        n, dev = layout.flat_numel, self.state_device
        param_dtype = layout.slots[0].local.dtype
        master, exp_avg = (torch.zeros(n, dtype=torch.float32, device=dev) for _ in range(2))
        grad_sum = host_empty(n, self.grad_accum_dtype or torch.float32, dev, pin).zero_()
        exp_avg_sq = None if self.rule is UpdateRule.LION else torch.zeros(n, dtype=torch.float32, device=dev)
        for slot in layout.slots:
            master[slot.offset : slot.offset + slot.numel].copy_(masters[id(slot.param)].reshape(-1))
        segments: list[Segment] = []
        updated_slots = []
        for slot in layout.slots:
            group = group_of.get(id(slot.param))
            if group is None:
                continue  # not in the optimizer: never updated, as with torch
            updated_slots.append(slot)
            end = slot.offset + slot.padded_numel
            if segments and segments[-1].group_index == group and segments[-1].end == slot.offset:
                segments[-1].end = end
            else:
                segments.append(Segment(group, slot.offset, end))
        grad_staging = host_empty(n, param_dtype, dev, pin)
        if param_dtype == torch.float32:
            param_staging = master  # fp32 shards (32-true) go back straight from the master
        else:
            param_staging = host_empty(n, param_dtype, dev, pin)
            param_staging.copy_(master)
        tensors = [master, exp_avg, grad_sum, grad_staging]
        tensors += [t for t in (exp_avg_sq, param_staging) if t is not None and t is not master]
        return HostUnit(layout, segments, updated_slots, master, exp_avg, exp_avg_sq, grad_sum, grad_staging, param_staging,
                        host_tensors=tensors)

    # -- backward -------------------------------------------------------------------------------------------

    def attach(self) -> None:
        """Register the reduce hook on every unit; FSDP2 then sums (not averages) gradients over ranks."""
        for unit, module in zip(self.units, self._modules):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no AVG; the 1/world goes into the step
            module.set_all_reduce_hook(lambda flat, unit=unit: self._on_unit_reduced(unit, flat), stream=self.copy_stream)

    def begin_backward(self, window_ends: bool) -> None:
        """Called before each backward; `window_ends`: it is the window's last (Lightning steps right after)."""
        self.window_ends = window_ends

    def _on_unit_reduced(self, unit: HostUnit, flat_grad: torch.Tensor) -> None:
        # Runs inside FSDP2's backward, on the copy stream; FSDP2's later use of `flat_grad` is on this stream too.
        if flat_grad.numel() != unit.layout.flat_numel:
            raise RuntimeError(
                f"zoff: unit {unit.layout.name!r} reduced {flat_grad.numel()} gradient elements, expected"
                f" {unit.layout.flat_numel}; this torch version lays out FSDP2 shards differently."
            )
        unit.grad_arrived = True
        if not self.accumulate_on_accelerator or (self.window_ends and not unit.has_grad):
            # host accumulation, or a window of one micro-batch: the 16-bit shard goes down as it is
            unit.grad_staging.copy_(flat_grad, non_blocking=True)
            self.traffic.d2h_bytes += unit.grad_staging.nbytes
        else:
            self._accumulate_on_accelerator(unit, flat_grad)
        unit.grad_copied = _record_event(self.param_device)

    def _accumulate_on_accelerator(self, unit: HostUnit, flat_grad: torch.Tensor) -> None:
        # The window's sum lives in an accelerator buffer; the host sees it once, at the window's end. Unless
        # retained, the buffer goes down to the host after every micro-batch and comes back (exactly) for the next.
        if unit.device_sum is None and unit.has_grad:
            unit.device_sum = unit.grad_sum.to(self.param_device, non_blocking=True, copy=True)
            self.traffic.h2d_bytes += unit.grad_sum.nbytes
        if unit.device_sum is None:
            unit.device_sum = flat_grad.to(unit.grad_sum.dtype, copy=True)
        else:
            unit.device_sum.add_(flat_grad)
        if self.window_ends or not self.retain_device_sum:
            unit.grad_sum.copy_(unit.device_sum, non_blocking=True)
            self.traffic.d2h_bytes += unit.grad_sum.nbytes

    @torch.no_grad()
    def after_backward(self) -> None:
        """Wait for this backward's copies, fold them into the window's sum, free the accelerator's gradients."""
        for unit in self.units:
            if unit.grad_arrived:
                if unit.grad_copied is not None:
                    unit.grad_copied.synchronize()
                if self.accumulate_on_accelerator and unit.device_sum is not None:
                    if self.window_ends or not self.retain_device_sum:
                        unit.device_sum = None  # the host holds the sum now
                elif unit.has_grad:
                    if unit.grad_in_staging:  # the staged gradient was just overwritten: refuse, never guess
                        raise RuntimeError("zoff: a second backward ran after the window's last one, before the step")
                    unit.grad_sum.add_(unit.grad_staging)
                elif self.window_ends:
                    unit.grad_in_staging = True
                else:
                    unit.grad_sum.copy_(unit.grad_staging)
                unit.has_grad, unit.grad_arrived = True, False
            for slot in unit.layout.slots:
                slot.param.grad = None

    @staticmethod
    def _window_grad(unit: HostUnit) -> torch.Tensor:
        return unit.grad_staging if unit.grad_in_staging else unit.grad_sum

    # -- step -----------------------------------------------------------------------------------------------

    def _global_grad_sumsq(self) -> float:
        sq = torch.zeros((), dtype=torch.float64)
        for unit in self.units:
            if not unit.has_grad:
                continue
            grad = self._window_grad(unit)
            if grad.device.type == "cpu":
                sq += ops.grad_sumsq_finite(grad, threads=self.threads)[0]
            else:
                sq += torch.linalg.vector_norm(grad, dtype=torch.float32).double().cpu() ** 2
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(sq)  # a CPU tensor: gloo, also under "cpu:gloo,cuda:nccl"
        return sq.item()

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, max_norm: float | None, loss_scale: float = 1.0) -> StepOutcome:
        """Update every unit that received a gradient in this window; every rank reaches the same decision.

        The host gradients are sums over ranks of the loss-scaled gradients: the true norm divides by both."""
        norm = math.sqrt(self._global_grad_sumsq()) / (self.world_size * loss_scale)
        if not math.isfinite(norm):  # inf or NaN anywhere (fp16 overflow included): change nothing
            self._close_window()
            return StepOutcome(norm, 1.0, skipped=True)
        clip_coef = 1.0
        if max_norm is not None and max_norm > 0:
            clip_coef = min(1.0, max_norm / (norm + 1e-6))
        scale = clip_coef / (self.world_size * loss_scale)
        hyper = [GroupHyperparams.of(g) for g in optimizer.param_groups]
        start = time.perf_counter()
        for unit in self.units:
            if not unit.has_grad:
                continue  # no gradient in this window: like torch, leave parameter and state alone
            if unit.params_copied is not None:
                unit.params_copied.synchronize()  # param_staging still feeds last step's copy
            grad = self._window_grad(unit)
            for seg in unit.segments:
                seg.step += 1
                s, e = seg.start, seg.end
                update(self.rule, hyper[seg.group_index], seg.step, unit.master[s:e], grad[s:e], unit.exp_avg[s:e],
                       None if unit.exp_avg_sq is None else unit.exp_avg_sq[s:e],
                       grad_scale=scale, out=None if unit.param_staging is unit.master else unit.param_staging[s:e],
                       threads=self.threads)
            for slot in unit.updated_slots:
                local = slot.local
                local.copy_(unit.param_staging[slot.offset : slot.offset + slot.numel].view_as(local), non_blocking=True)
                self.traffic.h2d_bytes += local.nbytes
            unit.params_copied = _record_event(self.param_device)
        self.traffic.cpu_update_s += time.perf_counter() - start
        self._close_window()
        return StepOutcome(norm, clip_coef, skipped=False)

    def take_traffic(self) -> Traffic:
        traffic, self.traffic = self.traffic, Traffic()
        return traffic

    def wait_idle(self) -> None:
        """Block until no update is in flight (the synchronous engine has none)."""
        return

    def _close_window(self) -> None:
        for unit in self.units:
            unit.has_grad = unit.grad_in_staging = False

    # -- accounting -----------------------------------------------------------------------------------------

    def memory_report(self) -> dict[str, float]:
        """Bytes this rank holds, by kind, and per parameter element of its shard."""
        local_numel = sum(s.numel for u in self.units for s in u.layout.slots)
        accel_params = sum(s.numel * s.local.element_size() for u in self.units for s in u.layout.slots)
        host = {
            "host_master": sum(u.master.nbytes for u in self.units),
            "host_optimizer_state": sum(t.nbytes for u in self.units for t in (u.exp_avg, u.exp_avg_sq) if t is not None),
            "host_grad_sum": sum(u.grad_sum.nbytes for u in self.units),
            "host_staging": sum(u.grad_staging.nbytes + (0 if u.param_staging is u.master else u.param_staging.nbytes)
                                for u in self.units),
        }
        host_total = sum(host.values())
        sum_bytes = [u.layout.flat_numel * u.grad_sum.element_size() for u in self.units]
        if not self.accumulate_on_accelerator:
            accel_sum = 0
        elif self.retain_device_sum:
            accel_sum = sum(sum_bytes)  # every unit's buffer for the whole window
        else:
            accel_sum = max(sum_bytes, default=0)  # one unit's, while its backward runs
        return {
            "local_params": local_numel,
            "accelerator_params": accel_params,
            # the largest unit's reduced gradient lives on the accelerator only until it reaches the host
            "accelerator_grad_peak": max((u.layout.flat_numel * u.grad_staging.element_size() for u in self.units), default=0),
            "accelerator_grad_sum": accel_sum,
            **host,
            "host_total": host_total,
            "accelerator_bytes_per_param": accel_params / max(local_numel, 1),
            "host_bytes_per_param": host_total / max(local_numel, 1),
        }


def describe_memory(report: dict[str, float]) -> str:
    """One line: sizes in MiB, ratios in bytes per parameter element."""
    parts = []
    for key, value in report.items():
        if key == "local_params":
            parts.append(f"{key}={int(value):,}")
        elif key.endswith("_per_param"):
            parts.append(f"{key}={value:.2f}")
        else:
            parts.append(f"{key}={value / 2**20:.1f} MiB")
    return ", ".join(parts)
