"""A rank's memory over a run, for either front door: the machine read once at setup, the plan checked before the model
is sharded (and the activation checkpointing "auto" chooses from it), "auto"'s moves after steps, room made after a
step ran the accelerator out of memory, the lines that report them, what an out-of-memory error says, and the host's
floor checked at each step. `ShardedTraining` owns one `RankMemory`; it drives the engine's `StateMover` through the
engine, and the bytes are the plan's."""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from lightning_zoff._compat import finish_failed_backward
from lightning_zoff.host_watch import HostMemoryLow, available_bytes, floor_bytes, stop_line
from lightning_zoff.launch.group import RankGroup, group_is_up
from lightning_zoff.launch.node_log import log_for_node
from lightning_zoff.placement.fsdp_buffers import UnitBuffers
from lightning_zoff.placement.machine import Machine, measure_machine, size
from lightning_zoff.placement.plan import (
    MemoryPlan,
    Placement,
    StateOptions,
    StepMemory,
    UnitShape,
    accelerator_bytes_per_element,
)
from lightning_zoff.placement.policy import accelerator_holds_all, back_for_room, plan_memory
from lightning_zoff.placement.recompute_choice import fewer_for_all_state, fewest_that_fit, switch_first
from lightning_zoff.placement.refusal import PlanDoesNotFit
from lightning_zoff.placement.step_costs import BlockTrade, HostRate, Rates, block_trade, measure_rates
from lightning_zoff.placement.step_trace import StepProbe, measure_step
from lightning_zoff.sharding import owned_params, padded_shard_numel, recompute_activations
from lightning_zoff.units import Unit, forward_order

if TYPE_CHECKING:  # the engine's type: this drives it, and loads none of the pipeline
    from lightning_zoff.config import ZoffConfig
    from lightning_zoff.offload import OffloadEngine

log = logging.getLogger("lightning_zoff")


class RankMemory:
    """The memory of the rank `group` describes, under `config`."""

    def __init__(self, config: ZoffConfig, group: RankGroup, host_rate: HostRate | None = None) -> None:
        self.config, self.group = config, group
        self.host_rate = host_rate  # the host's optimizer update, timed: "auto" weighs recompute against it
        self.machine: Machine | None = None  # read at setup
        self.report: dict[str, float] = {}  # the engine's memory report, after setup and after each move
        self._placing_by_peak = False  # "auto" on a GPU: after the next step, by its measured peak
        self._moved_back = False
        self._floor = floor_bytes(config.host_memory_floor)
        self.step: StepMemory | None = None  # the step's own memory on the accelerator, as traced at setup

    def read_machine(self, loader_workers: int = 0) -> Machine:
        """The machine every rank plans with (`measure_machine`: the least any rank measured); `loader_workers`: each
        rank's DataLoader workers, kept room for on the host."""
        self.machine = measure_machine(self.group, loader_workers)
        return self.machine

    def check_before_sharding(self, module: nn.Module, units: list[Unit], accumulate_grad_batches: int,
                              param_dtype: torch.dtype, probe: StepProbe | None = None,
                              recomputable: Sequence[nn.Module] = ()) -> None:
        """Refuse a model whose optimizer state and step cannot fit this machine before any of it (or the sharded model)
        is allocated: the engine's plan, assuming the optimizer trains every parameter that requires a gradient, with
        shards of `param_dtype`, and on a GPU the step at `probe`'s batch, traced on fake tensors. "auto" switches on
        the recompute installed (switched off) on the `recomputable` blocks where the accelerator cannot hold every
        unit's state beside the step: on all of them where it cannot even so, else on the fewest first ones that let
        it; but where a block's recompute costs more than the host's update of the state its activations displace, on
        the fewest with which the plan fits at all (`recompute_choice.py`, `_by_cost`)."""
        config, machine = self.config, self.machine
        assert machine is not None
        param_bytes = param_dtype.itemsize
        shapes, model_bytes = unit_shapes_before_sharding(module, units, self.group.world_size, param_bytes)
        forward = forward_order(module, units)
        shapes = in_forward_order(shapes, forward)
        # Adam's two moments: the most any supported optimizer keeps
        options = StateOptions.of(config, param_bytes=param_bytes, moments=2,
                                  sums_windows=accumulate_grad_batches > 1)
        buffers = UnitBuffers.of(module, units, param_bytes, forward, self.group.world_size,
                                 kept=not config.reshard_after_forward)
        traced = probe if machine.accelerator_capacity is not None else None  # a CPU holds any step

        def trace() -> StepMemory | None:
            return measure_step(module, traced, self.group.device, param_dtype, buffers.most, buffers)

        def plan_with(chosen: StateOptions) -> Callable[[StepMemory | None], MemoryPlan]:
            return lambda step: plan_memory(shapes, chosen, machine, config.accelerator_state, model_bytes=model_bytes,
                                            masters_bytes=model_bytes * 4 // param_bytes, step=step)

        if config.activation_checkpointing_policy != "auto" or not recomputable:
            self.step = trace()
            plan_with(options)(self.step)  # refuses what does not fit (with the staging ring where only it fits)
            self._say_step(self.step)
            return
        # "auto"'s blocks weighed without the staging ring, whose waits cost more than recompute spares (`RING_UNITS`);
        # with it only where no choice fits without
        first = replace(options, ring_only_to_fit=False)
        try:
            self._choose_recompute(recomputable, trace, plan_with(first), accumulate_grad_batches, first)
        except PlanDoesNotFit:
            if not options.ring_only_to_fit:
                raise
            switch_first(recomputable, 0)
            ringed = options.with_ring()
            self._choose_recompute(recomputable, trace, plan_with(ringed), accumulate_grad_batches, ringed)

    def _choose_recompute(self, recomputable: Sequence[nn.Module], trace: Callable[[], StepMemory | None],
                          plan_with: Callable[[StepMemory | None], MemoryPlan], accumulate_grad_batches: int,
                          options: StateOptions) -> None:
        """"auto" recompute (see `check_before_sharding`) with `plan_with`'s plans: switches the chosen blocks on and
        sets `self.step`, or raises `PlanDoesNotFit` where even all of them leave no plan that fits."""
        machine = self.machine
        assert machine is not None
        step = self.step = trace()
        try:
            kept_fits, recompute = True, not accelerator_holds_all(plan_with(step))
        except PlanDoesNotFit:
            if step is None:
                raise  # the state alone does not fit: recompute would not change that
            kept_fits, recompute = False, True
        if not recompute:
            self._say_step(step)
            return
        names = ", ".join(recompute_activations(recomputable))
        recomputed = self.step = trace()
        plan = plan_with(recomputed)  # refuses a step that does not fit even so
        if step is None or recomputed is None:
            self._say(f"recomputing {names} activations ('auto'): state {self._all_state(plan) / 1e9:.1f} GB + model"
                      f" {plan.model_bytes / 1e9:.1f} GB > GPU {(machine.accelerator_capacity or 0) / 1e9:.1f} GB")
            return

        fewer = fewer_for_all_state(recomputable, step, recomputed, trace, plan_with)
        most = len(recomputable) if fewer is None else fewer[0]
        cheaper = self._by_cost(recomputable, most, step, recomputed, kept_fits, trace, plan_with,
                                accumulate_grad_batches, options)
        if cheaper is not None:
            count, self.step, trade = cheaper
            self._say(f"recomputing {f'the first {count} of' if count else 'none of the'} {len(recomputable)}"
                      f" {names} blocks' activations ('auto', by cost: {trade.describe(accumulate_grad_batches)}):"
                      f" the step at {step.batch} needs {size(self.step.total)}, the host holds the state the GPU"
                      f" cannot beside it")
            return
        if fewer is None:
            self._say(f"recomputing {names} activations ('auto'): the step at {step.batch} needs {size(step.total)}"
                      f" without it, {size(recomputed.total)} with it")
            return
        count, self.step = fewer
        self._say(f"recomputing the first {count} of {len(recomputable)} {names} blocks' activations ('auto'): the"
                  f" step at {step.batch} needs {size(step.total)} without, {size(self.step.total)} with them"
                  f" ({size(recomputed.total)} with all): then the GPU can hold all the optimizer state beside it")

    def _by_cost(self, blocks: Sequence[nn.Module], most: int, kept: StepMemory, recomputed: StepMemory,
                 kept_fits: bool, trace: Callable[[], StepMemory | None], plan_with: Callable[[StepMemory], MemoryPlan],
                 micro_batches: int, options: StateOptions) -> tuple[int, StepMemory, BlockTrade] | None:
        """Where "auto" places the state too and a block's recompute costs more than the host's update of the state its
        activations displace (`step_costs.py`), fewer than the `most` blocks the memory rule recomputes: the fewest
        with which the plan fits at all, switched on, with their step and the trade; else None (nothing switched)."""
        config = self.config
        if not (config.offload and config.accelerator_state == "auto") or self.host_rate is None:
            return None
        moment_dtype = torch.bfloat16 if options.moment_bytes == 2 else torch.float32
        trade = block_trade(kept, recomputed, len(blocks), micro_batches, accelerator_bytes_per_element(options),
                            self._rates(moment_dtype))
        if not trade.keep_activations:
            return None
        cheaper = fewest_that_fit(blocks, most, kept if kept_fits else None, trace, plan_with)
        return None if cheaper is None else (*cheaper, trade)

    def _rates(self, moment_dtype: torch.dtype) -> Rates:
        """The rates every rank weighs with (`step_costs.measure_rates`): the fastest product and the slowest host over
        the ranks, both leaning to recompute as each rate does, so that every rank chooses the same blocks."""
        assert self.host_rate is not None
        rates = measure_rates(self.group.device, moment_dtype, self.host_rate)
        if self.group.world_size > 1 and group_is_up():
            reading = torch.tensor([rates.accelerator_flops_per_s, rates.host_s_per_element], dtype=torch.float64)
            dist.all_reduce(reading, op=dist.ReduceOp.MAX)  # a CPU tensor: gloo, also under "cpu:gloo,cuda:nccl"
            rates = Rates(float(reading[0]), float(reading[1]))
        return rates

    def _say_step(self, step: StepMemory | None) -> None:
        if step is not None:
            self._say(f"the plan counts {step.describe()}")

    @staticmethod
    def _all_state(plan: MemoryPlan) -> int:
        return plan.with_placement({u.name: Placement.ACCELERATOR for u in plan.shapes}).accelerator_bytes

    def check_host(self, step: int) -> None:
        """Stop the run (`HostMemoryLow`) when the host's available memory is under the floor on any rank of the
        node: every rank reads it, and all stop at the same step."""
        available = available_bytes()
        g = self.group
        if g.world_size > 1 and group_is_up():
            reading = torch.tensor([available], dtype=torch.int64)
            dist.all_reduce(reading, op=dist.ReduceOp.MIN)  # a CPU tensor: gloo, also under "cpu:gloo,cuda:nccl"
            available = int(reading.item())
        if available < self._floor:
            raise HostMemoryLow(stop_line(step, available, self._floor, int(self.report.get("host_total", 0))))

    def engine_built(self, engine: OffloadEngine) -> None:
        """Report the new engine's memory and placement; "auto" on a GPU places more after the first step."""
        config = self.config
        self._placing_by_peak = (config.offload and config.accelerator_state == "auto"
                                 and self.group.device.type == "cuda")
        self._moved_back = False
        self.report = engine.memory_report()
        r = self.report
        self._say(f"host {size(r['host_total'])} of {size(r['host_capacity'])} planned"
                  f" ({r['host_bytes_per_trained_param']:.1f} B/param), {int(r['spare_sets'])} spare set(s),"
                  f" {engine.threads} CPU thread(s)")
        ring = int(r["staging_ring_units"])
        if ring:
            why = ("a landing buffer per unit does not fit" if config.staging_ring_units == "auto"
                   else "`staging_ring_units`")
            self._say(f"host: gradient shards land in a staging ring of {ring} units' landings"
                      f" ({size(r['host_staging'])}: {why}); backward waits where the host's sums fall that far behind"
                      " (zoff/landing_wait_s)")
        workers = int(r["loader_workers"])
        self._say(f"host: {size(r['host_kept'])} kept for {workers} loader worker{'' if workers == 1 else 's'} and the"
                  f" OS; the run stops itself under {size(self._floor)} available")
        log.debug("zoff rank %d memory: %s", self.group.global_rank, describe_memory(r))
        if config.offload:
            self._say_placement(engine, f"{config.accelerator_state!r} at setup")

    def after_step(self, engine: OffloadEngine) -> None:
        """"auto" on a GPU, after a step: more state to the accelerator if the step's peak left room beside the margin,
        some back to the host if it ate into it; after a move, the next step is checked again."""
        if not self._placing_by_peak:
            return
        device = self.group.device
        # by what the step's blocks held, not what the allocator reserved: its cache (per stream) runs 10% over at 13B,
        # and it frees that cache when it needs the room (gpt13b b4 on 1x H200, 2026-12-03: 1.49 s/step against 1.74)
        peak = held_peak(device)
        there, back = engine.place_by_peak(peak, more=not self._moved_back)
        self._moved_back = self._moved_back or bool(back)  # never forth again: no oscillation
        self._placing_by_peak = bool(there or back)
        if back:
            torch.cuda.empty_cache()  # the cached blocks of the state moved back would count in the next peak
        torch.cuda.reset_peak_memory_stats(device)  # the next check reads the next step alone
        moved = f"{len(there)} moved there" if there else f"{len(back)} moved back" if back else "none moved"
        self._say_placement(engine, f"a step peaked at {peak / 1e9:.1f} GB, {moved}")
        if there or back:
            self.report = engine.memory_report()  # the placement now (benchmarks read it after fit)

    def _say_placement(self, engine: OffloadEngine, why: str) -> None:
        summary = engine.placement_summary()
        (accel, accel_bytes), (host, host_bytes) = summary["accelerator"], summary["host"]
        where = "GPU" if self.group.device.type == "cuda" else "accelerator"
        self._say(f"state: {accel} unit(s) on the {where} ({size(accel_bytes)}), {host} on the host"
                  f" ({size(host_bytes)}); {why}")

    def _say(self, line: str) -> None:
        g = self.group
        log_for_node(line, g.global_rank, g.local_rank, g.ranks_on_node)

    def make_room_after_oom(self, engine: OffloadEngine, module: nn.Module, recomputable: list[nn.Module]) -> bool:
        """A step ran the accelerator out of memory before its decision: forget its gradients and move state back to the
        host where it has room, or else switch on the recompute "auto" installed switched off on the `recomputable`
        blocks, so the same batch can run again (nothing was applied: the result is exact). Whether either happened;
        "auto" moves nothing there again after a move."""
        finish_failed_backward(module)
        engine.abandon_window()
        moved = engine.make_room() if self.config.offload else []
        if moved:
            self._moved_back = True
            if self.group.device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(self.group.device)
            self.report = engine.memory_report()
            self._say_placement(engine, f"a step ran out of memory there, {len(moved)} moved back; the batch runs"
                                        " again")
            return True
        switched = recompute_activations(recomputable)  # the activations: all that is left to make room from
        if not switched:
            return False
        where = "GPU" if self.group.device.type == "cuda" else "accelerator"
        self._say(f"the step ran out of {where} memory; recomputing {', '.join(switched)} activations from now on"
                  " ('auto'), the batch runs again")
        return True

    @contextmanager
    def explaining_oom(self, engine: OffloadEngine | None) -> Generator[None, None, None]:
        """zoff chose to keep optimizer state on the accelerator; a later, larger step must not die unexplained."""
        try:
            yield
        except torch.OutOfMemoryError as err:
            config = self.config
            units, nbytes = engine.placement_summary()["accelerator"] if engine is not None else (0, 0)
            if not units or not config.offload:
                raise
            assert engine is not None
            plan = engine.plan
            if back_for_room(plan, plan.machine.accelerator_margin):
                advice = ("Keep less there: ZoffStrategy(accelerator_state=<a smaller fraction>) or"
                          " accelerator_state='none'.")
            else:  # moving state to the host would only move the failure there
                advice = (f"The host has no room for more of it ({size(plan.host_bytes)} of"
                          f" {size(plan.machine.host_capacity)} planned there): optimizer_state_dtype='bf16',"
                          " activation checkpointing or a smaller batch leave the step more room; more GPUs split the"
                          " state.")
            raise torch.OutOfMemoryError(
                f"{err}\nzoff keeps the optimizer state of {units} unit(s) ({nbytes / 1e9:.1f} GB) on the"
                f" accelerator (accelerator_state={config.accelerator_state!r}), chosen from the steps' peak memory;"
                f" this step needed more. {advice}"
            ) from err


def unit_shapes_before_sharding(model: nn.Module, units: list[Unit], world_size: int,
                                param_bytes: int) -> tuple[list[UnitShape], int]:
    """Each unit's shape on a rank as the engine will see it once sharded, assuming the optimizer trains every
    parameter that requires a gradient (an upper bound of its state), and the bytes of the rank's shards of the
    model; from shapes alone, so a model on the meta device costs nothing to plan."""
    taken: dict[str, torch.Tensor] = {}
    shapes, model_bytes = [], 0
    for unit in units:  # the order shard_model takes them in: a unit owns what no earlier unit took
        reduced = 0
        for name, p in owned_params(model, unit, taken):
            taken[name] = p
            padded = padded_shard_numel(p.shape, world_size)
            model_bytes += padded * param_bytes
            reduced += padded if p.requires_grad else 0
        shapes.append(UnitShape(unit.name, reduced, reduced, True))
    return shapes, model_bytes


def in_forward_order(shapes: list[UnitShape], forward: Sequence[str]) -> list[UnitShape]:
    """`shapes` in the order a forward enters their units (`units.forward_order`), any it does not name last."""
    order = {name: i for i, name in enumerate(forward)}
    return sorted(shapes, key=lambda u: order.get(u.name, len(order)))


def gathered_bytes(model: nn.Module, units: list[Unit], param_bytes: int, order: Sequence[str],
                   world_size: int = 1) -> int:
    """FSDP2's share of a step on the accelerator at its most, from the units' sizes in forward order (`order`):
    `UnitBuffers.most`, for callers that have no `UnitBuffers` (find_largest's model of a size)."""
    return UnitBuffers.of(model, units, param_bytes, order, world_size).most


def held_peak(device: torch.device) -> int:
    """The most the accelerator's blocks held at once since the peak was reset: allocated, or freed but not yet
    reusable because another stream's work on them was pending (`record_stream`: FSDP2's reduced shards until their
    copy is done). `max_memory_allocated` stops counting a block when it is freed, the allocator can reuse it only
    later: the "active" bytes count it until then."""
    active = torch.cuda.memory_stats(device).get("active_bytes.all.peak")
    return int(active) if active is not None else torch.cuda.max_memory_allocated(device)


def describe_memory(report: dict[str, float]) -> str:
    """The memory report in one line: sizes in MiB, ratios in bytes per parameter element, counts as they are."""
    counts = ("local_params", "trained_params", "spare_sets", "staging_ring_units", "host_units", "accelerator_units")
    parts = []
    for key, value in report.items():
        if key in counts:
            parts.append(f"{key}={int(value):,}")
        elif "_per_" in key:
            parts.append(f"{key}={value / 1:.2f}")
        else:
            parts.append(f"{key}={value / 2**20:.1f} MiB")
    return ", ".join(parts)
