"""The data path of a gradient, per rank: from FSDP2's reduce-scatter to the updated 16-bit parameter shard.

1. Backward. FSDP2 reduce-scatters each unit's gradients into one flat shard as a plain sum over ranks (divide
   factor 1: the 1/world is folded into the step's scale) and calls `on_unit_reduced` on the copy stream (the hooks:
   `fsdp_hooks.py`). Just before, `_compat.before_reduce` notes which of the unit's parameters got a gradient in
   this backward and gives the others a zero one, so every rank reduces the same tensors (`on_grads_noted`). We copy
   the shard, still in the parameter dtype (2 B/param in 16-bit modes), into the unit's pinned `grad_staging` (where
   windows sum on the host with overlap, a slot of the staging ring the host units share, `in_ring`, held until the
   shard is in the sum: `placement/staging_ring.py`) without blocking, record an event and hand the unit to the host
   worker (`GradientLanding.land`; the worker, its priorities and the speculation: `scheduler.py`; this backward
   half: `landing.py`). The accelerator
   then frees FSDP2's copy as the next unit arrives, instead of holding every unit's gradient to the end. With
   `accumulate_on_accelerator`, the hook instead adds each shard into an fp32 buffer on the accelerator and the
   host receives the sum once, at the window's end (or after every micro-batch, freeing the buffer in between,
   unless `retain_device_sum`).
2. Landing (`GradientLanding.land`, on the worker while backward goes on). Wait for the copy; add the shard into the
   unit's fp32 host `grad_sum` when the window has more micro-batches (a window of one leaves it in `grad_staging`,
   which the kernel reads directly: promoting 16 to 32 bits is exact, so both give the same bits; with
   `accumulate_grad_batches=1` no `grad_sum` is allocated at all). At the window's end, take
   the unit's sum of squares and, with `overlap`, hand it on (`unit_ready`, the landing's next stage) to a
   speculative update (`UnitUpdates.speculate`, queued by `HostScheduler.speculate`): the fused kernel runs on the
   unit as if the step were neither clipped nor skipped and every parameter had a gradient, writing the new master,
   moments and 16-bit copy into a set of `spare` buffers lent by the scheduler's pool (as many sets as the plan has
   room for; a unit that finds none skips speculating). The committed state is never written.
   Host state exists only for the parameters the optimizer trains (`trained`): fp32 master and moments fp32 or bf16
   (`moment_dtype`: the kernel computes in fp32 and stores them rounded).
3. Decision (`step`, after backward). The global norm of the averaged gradient (the units' sums of squares in unit
   order, all-reduced with every parameter's used-in-the-window flag) decides: skip when it is not finite, else
   one combined scale 1/world x clip factor. A parameter no rank gave a gradient in the window is not updated at
   all (as torch skips `.grad is None`): no moment decay, no weight decay, its step count unchanged.
4. Finalize (`UnitUpdates.finalize` in `updates.py`, per unit, in the order the next forward needs them). Skip: drop
   the speculation. Otherwise, when the speculation was computed with this very scale, hyperparameters, steps and
   parameters it is the result; else the kernel runs in place on the untouched state (the spare set goes back to the
   pool, or the kept spare set becomes the state and the old state the pool's). In place, the kernel writes the
   16-bit copy over the gradient it just read (`param_staging` is `grad_staging` where their layouts agree; a unit
   `in_ring` writes it into a ring slot, given back once the copy up is done). Then
   copy the updated 16-bit shards host-to-device on a side stream into FSDP2's sharded parameters. The unit's next
   forward waits for exactly that copy (`gate`), nothing else does. A share of the host's units (`update_split.py`
   chooses them, `accelerator_update_share`) is instead updated by the accelerator: their master, moments and
   gradient go up in pieces, torch ops with the host kernels' arithmetic (the same bits) update them there and write
   FSDP2's shards, and master and moments come back (`lending.py`), while the host's cores update the rest.
A unit whose state is placed on the accelerator (`Placement.ACCELERATOR`) takes the same path there. In a window of
one micro-batch its reduced gradient is copied over FSDP2's shards of its trained parameters (until the step a shard
is only its master's cast), so FSDP2's reduced shard is freed at once and the accelerator holds no gradient per
parameter (`grad_in_shards`); in longer windows it is added into the window's sum as it arrives. The update runs inline
with torch ops (no spare, no worker) in pieces through one fp32 workspace, then casts the master into FSDP2's shards
(every trained one after `grad_in_shards`, a skipped step too), all on the training stream.
Every buffer is in the plan (`placement/plan.py`), whose policy chose each unit's placement before any was allocated;
the engine's `StateMover` (`placement/mover.py`) moves a unit's state between steps when the policy asks.
A unit's state and its phase in the window (EMPTY, SUMMING, READY, FINALIZING) are a `UnitState`
(`unit_state.py`); what the engine moved is counted in `accounting.py`.
Without `overlap` the same functions run inline: landing right after backward, the update in place at the step.
The kernels, their inputs and the order of every sum are the same, so both paths give the same bits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_zoff.offload.accounting import Traffic
from lightning_zoff.offload.decision import StepOutcome, decide
from lightning_zoff.offload.fsdp_hooks import UnitHooks, order_after_copy
from lightning_zoff.offload.landing import GradientLanding, LandingOptions
from lightning_zoff.offload.layout import unit_layouts, unit_shape
from lightning_zoff.offload.lending import fit_lending, lent_units
from lightning_zoff.offload.scheduler import HostScheduler, SparePool
from lightning_zoff.offload.unit_state import ParamState, Phase, UnitState, build_unit_state, param_states
from lightning_zoff.offload.update_split import UpdateSplit
from lightning_zoff.offload.updates import UnitUpdates
from lightning_zoff.optim.rules import UpdateRule, update_rule_for, warn_if_bf16_moments_cannot_decay
from lightning_zoff.placement import Machine, MemoryPlan, Placement, StateMover, StateOptions, plan_memory
from lightning_zoff.placement.host_buffers import is_pinned
from lightning_zoff.placement.plan import StepMemory

if TYPE_CHECKING:
    from lightning_zoff.config import ZoffConfig

__all__ = ["OffloadEngine", "StepOutcome"]


class OffloadEngine:
    """Holds one rank's fp32 master shard and optimizer state and runs the update for every FSDP2 unit. `masters`
    (fp32 shards by id of the sharded parameter) is emptied as the state takes them over; `machine`: what this rank
    may use; `forward_order`: the units' names as a forward is expected to enter them; `step`: the step's own memory
    on the accelerator, as traced at setup (the plan counts it)."""

    def __init__(self, units: list[tuple[str, nn.Module]], masters: dict[int, torch.Tensor],
                 optimizer: torch.optim.Optimizer, config: ZoffConfig, *, world_size: int, machine: Machine,
                 accumulate_grad_batches: int = 1, threads: int | None = None,
                 forward_order: Sequence[str] | None = None, step: StepMemory | None = None) -> None:
        self.config = config
        self.rule = update_rule_for(optimizer)
        self.optimizer = optimizer
        self.threads = threads  # CPU threads of the kernels; None: torch.get_num_threads()
        self.world_size = world_size
        self.traffic = Traffic()
        self.gate_wait_s = 0.0  # time forwards waited for this rank's updates (training thread only)
        # windows of one micro-batch need no sum (the kernel reads the landed shard); should the Trainer's count grow
        # later (GradientAccumulationScheduler), each unit allocates its sum when it first needs it
        self.sums_windows = accumulate_grad_batches > 1
        group_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        layouts = unit_layouts(units, world_size, set(group_of))
        params = [p for layout, _ in layouts for p in layout.params]
        self.param_device = params[0].device if params else torch.device("cpu")
        self.state_device = torch.device("cpu") if config.offload else self.param_device
        # units by name, in the order a forward enters them: guessed (`forward_order`) until the gates saw one
        guess = {name: i for i, name in enumerate(forward_order or ())}
        self.forward_order = sorted((layout.name for layout, _ in layouts), key=lambda n: guess.get(n, len(guess)))
        self._seen_forward: list[str] | None = []  # recorded by the gates until the first forward entered every unit
        moments = 1 if self.rule is UpdateRule.LION else 2
        by_name = {layout.name: layout for layout, _ in layouts}
        options = StateOptions.of(config, param_bytes=params[0].element_size() if params else 2, moments=moments,
                                  sums_windows=self.sums_windows)
        plan = plan_memory([unit_shape(by_name[name], group_of) for name in self.forward_order], options, machine,
                           config.accelerator_state if config.offload else "none", lion=moments == 1,
                           model_bytes=sum(t.nbytes for layout, _ in layouts for t in layout.local_shards),
                           masters_bytes=sum(t.nbytes for t in masters.values()), all_on_accelerator=not config.offload,
                           step=step)
        if config.moment_dtype == torch.bfloat16:
            warn_if_bf16_moments_cannot_decay(self.rule, optimizer)
        # the accelerator's units first: their fp32 copies leave the host before the host's state grows. Where the
        # accelerator takes a share of the host's updates, the host's state is pinned now, once: pinned as a unit is
        # first lent, the steps that lend new units wait for it (Llama-3-8B b1 on 1x H100: 1.4-2.4 s steps, 1.3 after)
        pin_state = config.pin_memory and plan.lends
        built: dict[str, UnitState] = {}
        for layout, _ in sorted(layouts, key=lambda lm: plan.placement[lm[0].name] is Placement.HOST):
            where = plan.placement[layout.name]
            built[layout.name] = build_unit_state(
                layout, masters, group_of, placement=where,
                device=self.state_device if where is Placement.HOST else self.param_device, moments=moments,
                moment_dtype=config.moment_dtype, sums_windows=self.sums_windows, grad_sum_dtype=config.grad_sum_dtype,
                pin=config.pin_memory and where is Placement.HOST,
                pin_state=pin_state and where is Placement.HOST, landing_ring=plan.options.landing_ring)
        self.units = [built[layout.name] for layout, _ in layouts]
        self._modules = [module for _, module in layouts]
        on_cuda = self.param_device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.param_device) if on_cuda else None  # D2H, FSDP2's hook runs here
        h2d_stream = torch.cuda.Stream(self.param_device) if on_cuda else None  # the host's 16-bit shards up
        self.compute_stream = torch.cuda.current_stream(self.param_device) if on_cuda else None
        self.scheduler = HostScheduler(SparePool()) if config.host_worker else None
        self.mover = StateMover(plan, self.units, None if self.scheduler is None else self.scheduler.pool,
                                host=self.state_device, accelerator=self.param_device,
                                grad_sum_dtype=config.grad_sum_dtype, moment_dtype=config.moment_dtype,
                                pin=config.pin_memory, pin_state=pin_state)
        self.updates = UnitUpdates(self.rule, optimizer, self.traffic, self.scheduler, world_size=world_size,
                                   threads=threads, h2d_stream=h2d_stream, compute_stream=self.compute_stream,
                                   ring=self.mover.ring)
        self.split: UpdateSplit | None = None  # with lending: which host units the accelerator updates each step
        self._fit_lending()
        self.landing = GradientLanding(
            self.units, LandingOptions(config.grad_sum_dtype, config.pin_memory, config.grad_accum_on == "accelerator",
                                       config.retain_gpu_grad_partition_until_step, threads),
            self.traffic, self.scheduler, self, param_device=self.param_device, copy_stream=self.copy_stream,
            compute_stream=self.compute_stream, ring=self.mover.ring)
        self._hooks: list[UnitHooks] = []
        self._detached = False

    @property
    def plan(self) -> MemoryPlan:
        return self.mover.plan

    # -- 1, 2. backward and landing: FSDP2's hooks call these, the landing calls `unit_ready` ----------------

    def attach(self) -> None:
        """Hook every unit with a parameter that requires a gradient: its reduce (FSDP2 then sums, not averages,
        gradients over ranks) and its forward (`gate`)."""
        for index, (unit, module) in enumerate(zip(self.units, self._modules, strict=True)):
            if unit.layout.slots:
                self._hooks.append(UnitHooks(module, self, index, self.copy_stream))

    def begin_backward(self, window_ends: bool, loss_scale: float = 1.0) -> None:
        """Called before each backward; `window_ends`: it is the window's last (Lightning steps right after)."""
        self.landing.begin_backward(window_ends, loss_scale)

    def on_grads_noted(self, index: int, used: list[bool]) -> None:
        self.landing.on_grads_noted(index, used)

    def on_unit_reduced(self, index: int, flat_grad: torch.Tensor) -> None:
        """FSDP2's reduce hook, on the copy stream: the unit's reduced shard goes down (or into its sum) and is queued
        to land (`GradientLanding.land`), which calls `unit_ready` at the window's end."""
        self.landing.on_unit_reduced(index, flat_grad)

    def after_backward(self) -> None:
        self.landing.after_backward()

    def unit_ready(self, unit: UnitState) -> None:
        """The landing's next stage (`LandingEvents`, on the worker): a host unit's window gradient is complete, so
        its update runs speculatively into a spare set at this backward's loss scale."""
        self.updates.speculate(unit, self.landing.loss_scale)

    # -- 3, 4. the step: the decision, then each unit's update finalized and sent ----------------------------

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, max_norm: float | None, loss_scale: float = 1.0) -> StepOutcome:
        """Decide this window's step (every rank reaches the same decision) and finalize every unit that received
        a gradient in it; with `overlap` the finalizing runs on the worker and this returns at once."""
        if self.scheduler is not None:
            self.scheduler.wait_for_landings()
        units = [u for u in self.units if u.phase is not Phase.EMPTY]
        decision, outcome = decide(units, optimizer, max_norm, world_size=self.world_size, loss_scale=loss_scale,
                                   sumsq=self.landing.sumsq)
        as_speculated = not outcome.skipped and outcome.clip_coef == 1.0  # a speculation would have been kept
        if self.scheduler is not None:
            self.scheduler.decided(as_speculated=as_speculated)
        landed = self.landing.landed_order
        order = landed[::-1] + [u for u in units if u not in landed]  # about the order the next forward needs them
        lent = lent_units(self.updates.lent, self.split, self.updates.take_host_timing, order, decision, as_speculated)
        if not decision.skipped:  # counted here, so each step reports its own copies even when they end during the next
            host_units = [unit for unit in units if unit.placement is Placement.HOST and unit not in lent]
            self.traffic.add(h2d_bytes=sum(p.slot.local.nbytes for unit in host_units
                                           for p, used in zip(unit.trained, decision.used[unit], strict=True) if used))
            for unit, elements in lent.items():  # its state goes up and back, its gradient up; no 16-bit copy goes up
                state = elements * sum(t.element_size() for t in unit.state)
                assert unit.window_grad is not None
                self.traffic.add(lent_units=1, lent_elements=elements, d2h_bytes=state,
                                 h2d_bytes=state + elements * unit.window_grad.element_size())
        order.sort(key=lambda unit: unit not in lent)  # queuing a lent update takes a moment; it then streams
        for unit in order:
            unit.phase = Phase.FINALIZING
            if self.scheduler is not None and self.landing.on_worker(unit):
                self.scheduler.finalize(functools.partial(self.updates.finalize, unit, decision, unit in lent))
        for unit in order:  # the accelerator's units meanwhile, queued on its stream
            if unit.phase is Phase.FINALIZING and not self.landing.on_worker(unit):
                self.updates.finalize(unit, decision, unit in lent)
        return outcome

    def _fit_lending(self) -> None:
        """Slots for the lent updates as the plan has them now, and the split (`lending.fit_lending`); at setup and
        after a move (which waited for every update in flight)."""
        pinned = all(is_pinned(unit.master) for unit in self.units if unit.placement is Placement.HOST and unit.trained)
        self.mover.plan, self.updates.lent, self.split = fit_lending(
            self.plan, self.updates.lent, self.split, rule=self.rule, device=self.param_device,
            moment_dtype=self.config.moment_dtype, state_pinned=pinned)

    # -- the next forward: each unit waits for its own update -----------------------------------------------

    def gate(self, index: int) -> None:
        """Before a unit's forward: wait until its update is decided and on its way, then order FSDP2's all-gather
        of its shards after that copy."""
        unit = self.units[index]
        if unit.grad_in_shards:
            raise RuntimeError(
                f"zoff: unit {unit.layout.name!r} ran a forward between the window's last backward and the optimizer"
                " step. zoff keeps that gradient where the unit's 16-bit parameters were: step the optimizer first.")
        if self._seen_forward is not None and unit.layout.name not in self._seen_forward:
            self._seen_forward.append(unit.layout.name)
            if len(self._seen_forward) == len(self._hooks):  # seen whole: forwards stop paying for the record
                self._take_seen_forward()
        if self.scheduler is not None:
            self.gate_wait_s += self.scheduler.wait_finalized(unit)
        order_after_copy(unit.params_copied, self._modules[index], self.param_device)

    def wait_idle(self) -> None:
        """Block until no update is in flight: the state and the accelerator's shards are this step's."""
        if self.scheduler is not None:
            self.scheduler.wait_idle()
        if self.updates.lent is not None:
            self.updates.lent.wait()
        for unit in self.units:
            if unit.params_copied is not None:
                unit.params_copied.synchronize()

    def take_traffic(self) -> Traffic:
        """What the steps moved and spent since the last call (the worker may be counting meanwhile)."""
        return self.traffic.take()

    def take_gate_wait(self) -> float:
        seconds, self.gate_wait_s = self.gate_wait_s, 0.0
        return seconds

    def memory_report(self) -> dict[str, float]:
        return self.mover.report()

    def held_bytes(self) -> dict[str, int]:
        """What the engine's tensors hold now: per side, and the lent updates' slots and workspace on the accelerator
        (`MemoryPlan.lending_bytes`)."""
        lent = self.updates.lent
        return {**self.mover.held_bytes(), "lending": 0 if lent is None else lent.nbytes}

    # -- state, for checkpoints and the next fit ------------------------------------------------------------

    def param_states(self) -> list[ParamState]:
        """Every sharded parameter of the units with this rank's state, as views (after any update in flight)."""
        self.wait_idle()
        return [state for unit in self.units for state in param_states(unit)]

    def set_steps(self, steps: dict[nn.Parameter, int]) -> None:
        """Set trained parameters' step counts (a restored checkpoint's)."""
        for unit in self.units:
            for param in unit.trained:
                if param.slot.param in steps:
                    param.step = int(steps[param.slot.param])

    @torch.no_grad()
    def send_masters(self) -> None:
        """Make every trained shard on the accelerator the cast of its master again (after the masters were loaded)."""
        self.wait_idle()
        for unit in self.units:
            if unit.in_ring and not unit.fp32_params:  # through a slot of the staging ring, given back at once
                assert self.mover.ring is not None
                out, slot = self.mover.ring.take(unit.master.numel(), unit.param_dtype)
                self.updates.send(unit, unit.trained, out.copy_(unit.master), non_blocking=False)
                self.mover.ring.release(slot)
                continue
            if unit.param_staging is not None and not unit.fp32_params:
                unit.param_staging.copy_(unit.master)
            self.updates.send(unit, unit.trained, unit.param_staging, non_blocking=False)

    # -- placement: the mover's, between steps --------------------------------------------------------------

    def move(self, names: Sequence[str], placement: Placement) -> list[str]:
        """Move the named units' state to `placement` (exact copies, after any update in flight); the names moved."""
        self.wait_idle()
        moved = self.mover.move(names, placement)
        self._fit_lending()
        return moved

    @torch.no_grad()
    def abandon_window(self) -> None:
        """Forget the window's gradients (its step failed before the decision and runs again): every unit EMPTY, its
        state untouched (speculations only ever wrote spare sets), shards that held a gradient their masters' cast."""
        if self.scheduler is not None:
            self.scheduler.decided(as_speculated=self.scheduler.speculating)  # queued speculations are stale
            self.scheduler.wait_idle()
        self._restore_shards()
        for unit in self.units:
            if self.scheduler is not None:
                self.scheduler.release(unit)
            unit.speculation, unit.sumsq, unit.window_grad, unit.device_sum = None, None, None, None
            unit.used = [False] * len(unit.used)
            unit.phase = Phase.EMPTY
            unit.staging_free.set()
        self.landing.after_backward_failed()

    def make_room(self) -> list[str]:
        """Move state back to the host after the accelerator ran out of memory (`StateMover.make_room`), between steps
        or after `abandon_window`; the names moved."""
        self.wait_idle()
        moved = self.mover.make_room()
        self._fit_lending()
        return moved

    def place_by_peak(self, peak: int, more: bool = True) -> tuple[list[str], list[str]]:
        """After a step whose accelerator memory peaked at `peak` bytes: units to the accelerator or back
        (`StateMover.place_by_peak`), in the forward order the first forward showed; the names moved (there, back)."""
        self.wait_idle()
        self._take_seen_forward()
        moved = self.mover.place_by_peak(peak, self.forward_order, more)
        self._fit_lending()
        return moved

    def _take_seen_forward(self) -> None:
        seen, self._seen_forward = self._seen_forward or [], None
        self.forward_order = seen + [name for name in self.forward_order if name not in seen]

    def placement_summary(self) -> dict[str, tuple[int, int]]:
        return self.mover.summary()

    def fp32_shards(self) -> dict[int, torch.Tensor]:
        """Copies of this rank's fp32 rows of every sharded parameter of the units, by id of the parameter (the master
        where trained, else the accelerator's value): the `masters` an engine for a later optimizer starts from."""
        return {id(s.param): (s.local.detach().to(self.state_device, torch.float32, copy=True)
                              if s.master is None else s.master.clone()) for s in self.param_states()}

    # -- lifetime -------------------------------------------------------------------------------------------

    def detach(self) -> None:
        """Stop training with this engine (the end of a fit): wait for its work, remove its hooks, end its worker
        thread and restore the switch interval. The state stays for checkpoints and the next fit's `fp32_shards`;
        it goes with the engine. Detaching again does nothing."""
        if self._detached:
            return
        self._detached = True
        try:
            self.wait_idle()
            self._restore_shards()
        finally:
            for hooks in self._hooks:
                hooks.remove()
            self._hooks.clear()
            if self.scheduler is not None:
                self.scheduler.close()
                self.scheduler = self.landing.scheduler = self.updates.scheduler = None

    @torch.no_grad()
    def _restore_shards(self) -> None:
        """Units whose shards hold a gradient no step took (a fit that ended, or a step that failed, between backward
        and step): make the shards the cast of their masters again, so the model's weights are the state's."""
        for unit in self.units:
            if unit.grad_in_shards:
                self.updates.send(unit, unit.trained, None, non_blocking=False)
                unit.grad_in_shards = False

    def close(self) -> None:
        """Detach and let go of the state (a new engine replaces this one)."""
        self.detach()
        self.units.clear()  # the landing's and the mover's too
        self._modules, self.landing.landed_order = [], []
