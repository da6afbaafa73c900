"""A unit's gradient on its way to the step, per rank: FSDP2's reduced shard into the unit's landing buffer, the
window's sum, its sum of squares. The engine owns one `GradientLanding` (its docstring tells the whole path)."""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from lightning_zoff.offload.accounting import Traffic
from lightning_zoff.offload.fsdp_hooks import record_event
from lightning_zoff.offload.grad_math import accumulate, sum_of_squares, sum_of_squares_of
from lightning_zoff.offload.scheduler import HostScheduler
from lightning_zoff.offload.unit_state import Phase, UnitState
from lightning_zoff.placement import Placement
from lightning_zoff.placement.host_buffers import host_empty
from lightning_zoff.placement.plan import REDUCED_IN_FLIGHT
from lightning_zoff.placement.staging_ring import StagingRing


@dataclass(frozen=True)
class LandingOptions:
    grad_sum_dtype: torch.dtype  # of the window's sum
    pin_memory: bool
    accumulate_on_accelerator: bool  # grad_accum_on == "accelerator"
    retain_device_sum: bool  # retain_gpu_grad_partition_until_step
    threads: int | None  # of the host kernels


class LandingEvents(Protocol):
    """What the landing tells the engine: the next stage of a gradient's path."""

    def unit_ready(self, unit: UnitState) -> None:
        """The host unit's window gradient is complete, with its sum of squares (on the worker, with overlap)."""


class GradientLanding:
    """The backward half of the engine: the hooks' `on_grads_noted` and `on_unit_reduced` land here, and
    `land` folds each arrival into its window (on the scheduler's worker, or inline). `events.unit_ready(unit)` is
    called for each host unit whose window's gradient is complete, on the worker."""

    def __init__(self, units: list[UnitState], options: LandingOptions, traffic: Traffic,
                 scheduler: HostScheduler | None, events: LandingEvents, *,
                 param_device: torch.device, copy_stream: torch.cuda.Stream | None,
                 compute_stream: torch.cuda.Stream | None, ring: StagingRing | None = None) -> None:
        self.units = units  # the engine's list
        self.options = options
        self.traffic = traffic
        self.scheduler = scheduler  # None without overlap (and once the engine detached)
        self.events = events
        self.param_device = param_device
        self.copy_stream = copy_stream  # D2H: FSDP2 calls `on_unit_reduced` on it
        self.compute_stream = compute_stream  # the training loop's: where the accelerator's units update
        self.ring = ring  # the host units' shared landing room (`UnitState.in_ring`), with `StateOptions.landing_ring`
        self.window_ends = False  # this backward is its window's last (the step follows)
        self.loss_scale = 1.0
        self.landed_order: list[UnitState] = []  # this backward's units, in the order their gradients arrived
        # this backward's reduced shards' copies not yet seen done (`begin_backward` forgets the last one's)
        self.copies_in_flight: deque[torch.cuda.Event] = deque()

    def begin_backward(self, window_ends: bool, loss_scale: float) -> None:
        self.window_ends = window_ends
        self.loss_scale = loss_scale
        self.landed_order = []
        self.copies_in_flight.clear()

    def on_worker(self, unit: UnitState) -> bool:
        """Whether the unit's host work runs on the scheduler's worker (with overlap, for units on the host) rather
        than inline in the training thread (without overlap, or state on the accelerator)."""
        return self.scheduler is not None and unit.placement is Placement.HOST

    def _grad_sum(self, unit: UnitState) -> torch.Tensor:
        """The unit's window sum, allocated when a window of several micro-batches first needs it."""
        if unit.grad_sum is None:
            pin = self.options.pin_memory and unit.placement is Placement.HOST
            unit.grad_sum = host_empty(unit.layout.flat_numel, self.options.grad_sum_dtype, unit.device, pin).zero_()
        return unit.grad_sum

    def on_grads_noted(self, index: int, used: list[bool]) -> None:
        # FSDP2 is about to reduce the unit: which of its parameters got a gradient on this rank (the others get zeros)
        unit = self.units[index]
        if len(used) != len(unit.used):
            raise RuntimeError(
                f"zoff: unit {unit.layout.name!r} has {len(used)} parameters that require a gradient, {len(unit.used)}"
                " when fit started. Set requires_grad before trainer.fit; zoff fixes what it trains for each fit."
            )
        unit.used = [a or b for a, b in zip(unit.used, used, strict=True)]

    def on_unit_reduced(self, index: int, flat_grad: torch.Tensor) -> None:
        # Runs inside FSDP2's backward, on the copy stream; FSDP2's later use of `flat_grad` is on this stream too.
        unit = self.units[index]
        if flat_grad.numel() != unit.layout.flat_numel:
            raise RuntimeError(
                f"zoff: unit {unit.layout.name!r} reduced {flat_grad.numel()} gradient elements, expected"
                f" {unit.layout.flat_numel}; this torch version lays out FSDP2 shards differently."
            )
        if self.landed_order:  # FSDP2 made the last unit's gradients its `.grad`s by now: the engine has them
            self._drop_accelerator_grads(self.landed_order[-1])
        waited_from = time.perf_counter()
        unit.staging_free.wait()  # the worker still reads the previous micro-batch's shard (rare: it keeps up)
        unit.staging_free.clear()
        window_ends = self.window_ends
        if unit.placement is Placement.ACCELERATOR and window_ends and unit.phase is Phase.EMPTY:
            self._write_over_shards(unit, flat_grad)
        elif unit.placement is Placement.ACCELERATOR:  # a longer window: into its sum at once, on this stream
            self._accumulate(unit, self._grad_sum(unit), flat_grad, replace=unit.phase is Phase.EMPTY)
        elif not self.options.accumulate_on_accelerator or (window_ends and unit.phase is Phase.EMPTY):
            # host accumulation, or a window of one micro-batch: the 16-bit shard goes down as it is
            if unit.in_ring:  # into the ring, until the worker has added it into the window's sum
                assert self.ring is not None
                assert unit.staging_slot is None
                unit.grad_staging, unit.staging_slot = self.ring.take(unit.layout.flat_numel, unit.param_dtype)
            waited = time.perf_counter() - waited_from
            assert unit.grad_staging is not None
            unit.grad_staging.copy_(flat_grad, non_blocking=True)
            self.traffic.add(d2h_bytes=unit.grad_staging.nbytes, landing_wait_s=waited)
        else:
            self._accumulate_on_accelerator(unit, flat_grad, window_ends)
        # the accelerator may reuse the shard's memory once this stream's copies are done, not before
        self._keep_until_read(flat_grad, self.copy_stream)
        unit.grad_copied = record_event(self.copy_stream)
        self._bound_copies_in_flight(unit.grad_copied)
        self.landed_order.append(unit)
        if self.scheduler is not None and self.on_worker(unit):
            event = unit.grad_copied
            self.scheduler.land(functools.partial(self.land, unit, window_ends),
                                ready=None if event is None else event.query)

    @staticmethod
    @torch.no_grad()
    def _write_over_shards(unit: UnitState, flat_grad: torch.Tensor) -> None:
        """A window of one micro-batch on the accelerator: copy each trained parameter's gradient over its own shard
        (FSDP2 reads the shards again only in the next forward, which waits for the step's update; until then a shard
        is just the cast of its master; one multi-tensor copy, not a launch each) and let FSDP2's reduced shard go with
        the next unit's arrival. The accelerator then holds no gradient of its units until the step, instead of one per
        parameter of every such unit."""
        shards = [param.slot.local.view(-1) for param in unit.trained]
        if shards:  # (torch refuses an empty list)
            torch._foreach_copy_(shards, [flat_grad[param.slot.offset : param.slot.offset + shard.numel()]
                                          for param, shard in zip(unit.trained, shards, strict=True)])
        unit.grad_in_shards = True

    @staticmethod
    def _keep_until_read(tensor: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """FSDP2 allocated the reduced shard on its reduce-scatter stream: freed, it waits for `stream`'s work."""
        if stream is not None:
            tensor.record_stream(stream)

    def _bound_copies_in_flight(self, copied: torch.cuda.Event | None) -> None:
        """Hold the thread that runs backward while more than `REDUCED_IN_FLIGHT` reduced shards wait for their copy.
        A shard's memory is reusable only once the copy stream passed it (`_keep_until_read`), so a thread running
        ahead of the GPU would keep most of a backward's shards at once, in blocks `max_memory_allocated` no longer
        counts (gpt13b b4, 1x H200: 14 shards, 8.8 GB, and an allocator retry every step). The plan counts the bound
        (`placement/rank.py`, `gathered_bytes`); the thread waits only where the copies are slower than backward, which
        the step then waits for anyway."""
        if copied is None:  # CPU copies are synchronous
            return
        self.copies_in_flight.append(copied)
        while len(self.copies_in_flight) > REDUCED_IN_FLIGHT:
            self.copies_in_flight.popleft().synchronize()

    @staticmethod
    def _drop_accelerator_grads(unit: UnitState) -> None:
        """Free FSDP2's `.grad` views of the unit's reduced shard: the host has its copy (or the engine holds the
        shard), so the accelerator need not keep every unit's gradient until the end of backward."""
        for slot in unit.layout.slots:
            slot.param.grad = None

    def _accumulate_on_accelerator(self, unit: UnitState, flat_grad: torch.Tensor, window_ends: bool) -> None:
        # The window's sum lives in an accelerator buffer; the host sees it once, at the window's end. Unless
        # retained, the buffer goes down to the host after every micro-batch and comes back (exactly) for the next.
        grad_sum = self._grad_sum(unit)
        if unit.device_sum is None and unit.phase is not Phase.EMPTY:
            unit.device_sum = grad_sum.to(self.param_device, non_blocking=True, copy=True)
            self.traffic.add(h2d_bytes=grad_sum.nbytes)
        if unit.device_sum is None:
            unit.device_sum = flat_grad.to(grad_sum.dtype, copy=True)
        else:
            unit.device_sum.add_(flat_grad)
        if window_ends or not self.options.retain_device_sum:
            grad_sum.copy_(unit.device_sum, non_blocking=True)
            self.traffic.add(d2h_bytes=grad_sum.nbytes)

    @torch.no_grad()
    def after_backward(self) -> None:
        """Free the accelerator's gradients (the copies are ordered before any reuse of their memory by FSDP2's
        end of backward); without overlap, land every unit now."""
        for unit in self.landed_order:
            if not self.on_worker(unit):
                self.land(unit, self.window_ends)
        for unit in self.units:
            self._drop_accelerator_grads(unit)

    def after_backward_failed(self) -> None:
        """Drop what a failed backward left: FSDP2's gradients and the order units arrived in."""
        for unit in self.units:
            self._drop_accelerator_grads(unit)
        self.landed_order = []

    @torch.no_grad()
    def land(self, unit: UnitState, window_ends: bool) -> None:
        """Fold the arrived shard into the window's sum; at the window's end take its sum of squares."""
        try:
            assert unit.phase is not Phase.FINALIZING, "a unit lands between its decision and its update"
            if unit.phase is Phase.READY and unit.window_grad is not unit.grad_sum:
                # the window's gradient was just overwritten: refuse, never guess
                raise RuntimeError("zoff: a second backward ran after the window's last one, before the step")
            if unit.grad_copied is not None:
                if unit.placement is Placement.HOST:
                    unit.grad_copied.synchronize()
                else:  # what reads the shard is queued after it on the accelerator
                    torch.cuda.current_stream(unit.device).wait_event(unit.grad_copied)
            if unit.grad_in_shards:  # the window's one micro-batch, in the shards already
                unit.phase = Phase.READY
                unit.sumsq = sum_of_squares_of([param.slot.local for param in unit.trained])
                return
            arrived = unit.grad_staging
            if unit.placement is Placement.ACCELERATOR:  # summed as it arrived (`on_unit_reduced`)
                unit.window_grad = unit.grad_sum
            elif self.options.accumulate_on_accelerator and unit.device_sum is not None:
                if window_ends or not self.options.retain_device_sum:
                    unit.device_sum = None  # the host holds the sum now
                unit.window_grad = self._grad_sum(unit)
            elif unit.phase is not Phase.EMPTY:
                assert arrived is not None
                self._accumulate(unit, self._grad_sum(unit), arrived)
            elif window_ends and not unit.in_ring:
                unit.window_grad = arrived  # the kernel reads it there
            else:
                assert arrived is not None
                unit.window_grad = self._accumulate(unit, self._grad_sum(unit), arrived, replace=True)
            unit.phase = Phase.READY if window_ends else Phase.SUMMING
            if window_ends:
                unit.sumsq = self.sumsq(unit)
                if self.on_worker(unit):
                    self.events.unit_ready(unit)
        finally:
            if unit.in_ring and unit.staging_slot is not None:  # added into the sum (or failed): the ring's again
                assert self.ring is not None
                self.ring.release(unit.staging_slot)
                unit.grad_staging = unit.staging_slot = None
            if unit.grad_staging is None or unit.window_grad is not unit.grad_staging:
                unit.staging_free.set()
            if self.scheduler is not None and self.on_worker(unit):
                self.scheduler.landed()

    def _accumulate(self, unit: UnitState, total: torch.Tensor, shard: torch.Tensor, replace: bool = False
                    ) -> torch.Tensor:
        return accumulate(total, shard, replace=replace, kernel=self._on_host_kernels(unit),
                          threads=self.options.threads)

    def sumsq(self, unit: UnitState) -> float:
        """The sum of squares of the unit's window gradient (the trained parameters' part)."""
        assert unit.window_grad is not None
        return sum_of_squares(unit.window_grad, unit.grad_spans, kernel=self._on_host_kernels(unit),
                              threads=self.options.threads)

    @staticmethod
    def _on_host_kernels(unit: UnitState) -> bool:
        return unit.placement is Placement.HOST and unit.device.type == "cpu"
