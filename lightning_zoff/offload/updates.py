"""The update half of the engine, per rank: a unit's update for the decided step (or, with overlap, its speculation
before the decision), made the unit's state, and its 16-bit parameters sent into FSDP2's shards. The engine owns one
`UnitUpdates` beside its `GradientLanding`; `engine.py`'s docstring tells a gradient's whole path (steps 2 to 4
happen here)."""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from lightning_zoff.offload.accounting import Traffic
from lightning_zoff.offload.decision import Decision
from lightning_zoff.offload.fsdp_hooks import record_event
from lightning_zoff.offload.lending import LentUpdates
from lightning_zoff.offload.scheduler import HostScheduler
from lightning_zoff.offload.unit_state import Phase, TrainedParam, UnitState, UpdateKey, kernel_runs
from lightning_zoff.optim.rules import GroupHyperparams, UpdateRule
from lightning_zoff.optim.update import update, update_many
from lightning_zoff.placement import Placement
from lightning_zoff.placement.plan import UPDATE_PIECE
from lightning_zoff.placement.staging_ring import StagingRing


class UnitUpdates:
    """Runs units' updates with the `rule` and the current hyperparameters of `optimizer`'s param groups: on the host
    with the fused kernels (`threads` of them), on the accelerator with torch ops in bounded pieces. `scheduler`: the
    worker with overlap (None without, and once the engine detached); `h2d_stream` carries the host's 16-bit shards up,
    `compute_stream` is the training loop's; `lent`: the accelerator's runs of host units' updates, where it takes a
    share of them (`lending.py`)."""

    def __init__(self, rule: UpdateRule, optimizer: torch.optim.Optimizer, traffic: Traffic,
                 scheduler: HostScheduler | None, *, world_size: int, threads: int | None,
                 h2d_stream: torch.cuda.Stream | None, compute_stream: torch.cuda.Stream | None,
                 ring: StagingRing | None = None) -> None:
        self.rule = rule
        self.optimizer = optimizer
        self.traffic = traffic
        self.scheduler = scheduler
        self.world_size = world_size
        self.threads = threads
        self.h2d_stream = h2d_stream
        self.compute_stream = compute_stream
        self.ring = ring  # where host units `in_ring` write their 16-bit parameters, until they went up
        self.lent: LentUpdates | None = None  # the engine sets it where the plan lends (`_fit_lending`)
        self._host_timing = (0.0, 0)  # the host's decided updates since the last `take_host_timing`: seconds, elements

    def hyper(self) -> tuple[GroupHyperparams, ...]:
        return tuple(GroupHyperparams.of(g) for g in self.optimizer.param_groups)

    def speculate(self, unit: UnitState, loss_scale: float) -> None:
        """Queue the unit's update on the worker as if the step will be neither clipped nor skipped (`scheduler.py`)."""
        assert self.scheduler is not None
        scale = 1.0 / (self.world_size * loss_scale)
        # as if every parameter had a gradient and nothing is clipped or skipped
        self.scheduler.speculate(unit, lambda: self.key(unit, scale, self.hyper(), [True] * len(unit.trained)),
                                 self.update)

    @staticmethod
    def key(unit: UnitState, scale: float, hyper: tuple[GroupHyperparams, ...], used: list[bool]) -> UpdateKey:
        runs = kernel_runs(unit.trained, used)
        return UpdateKey(scale, runs, tuple(hyper[run.group_index] for run in runs))

    @torch.no_grad()
    def finalize(self, unit: UnitState, decision: Decision, lend: bool = False) -> None:
        """Make the decided update the unit's state and send its parameters on; `lend`: the accelerator runs it
        (`lending.py`), unless a kept speculation already holds it."""
        assert unit.phase is Phase.FINALIZING, "a unit finalized outside its step"
        try:
            if not decision.skipped:
                key = self.key(unit, decision.scale, decision.hyper, decision.used[unit])
                outcome = None if self.scheduler is None else self.scheduler.judge(unit, key)
                if outcome is not None:
                    self.traffic.add(**{f"speculations_{outcome}": 1})
                if outcome != "kept" and lend:
                    assert self.lent is not None
                    self.lent.update(unit, key)
                    self._count_steps(unit, decision.used[unit])  # its parameters are in the shards already
                    return
                if outcome != "kept":
                    self.update(unit, key)
                self._commit(unit, decision.used[unit])
            elif unit.grad_in_shards:  # nothing changes, but the shards hold the gradient: cast the masters again
                self.send(unit, unit.trained, None, non_blocking=True)
        finally:
            if unit.staging_slot is not None:  # the 16-bit parameters' slot: the ring's again once they went up
                assert self.ring is not None
                self.ring.release(unit.staging_slot, after=unit.params_copied)
                unit.param_staging = unit.staging_slot = None
            if self.scheduler is not None:
                self.scheduler.release(unit)  # a skipped step's speculation
            unit.speculation, unit.sumsq, unit.window_grad = None, None, None
            unit.grad_in_shards = False
            unit.phase = Phase.EMPTY
            unit.staging_free.set()

    def update(self, unit: UnitState, key: UpdateKey) -> None:
        """Run the update over every run of the key: into the spare set when speculating, else in place. On the host one
        kernel call per run (its threads split it); on the accelerator in pieces, through a bounded fp32 workspace."""
        on_host = unit.placement is Placement.HOST
        if on_host and not unit.in_ring and unit.params_copied is not None:  # param_staging feeds the last copy up
            unit.params_copied.synchronize()
        if unit.state_back is not None:  # the accelerator ran its last update: the state is coming back
            unit.state_back.synchronize()
        if unit.grad_in_shards:
            self._update_from_shards(unit, key)
            return
        grad, state, spare = unit.window_grad, unit.state, unit.spare
        assert grad is not None
        if unit.in_ring and spare is None and not unit.fp32_params:  # `finalize` gives the slot back
            assert self.ring is not None
            assert unit.staging_slot is None
            unit.param_staging, unit.staging_slot = self.ring.take(unit.master.numel(), unit.param_dtype)
        out = spare.out if spare is not None else unit.param_staging
        if unit.fp32_params:
            out = None  # the master is what goes to the accelerator
        start = time.perf_counter()
        for run, hyper in zip(key.runs, key.hyper, strict=True):
            piece = run.numel if on_host else UPDATE_PIECE
            for offset in range(0, run.numel, piece):
                numel = min(piece, run.numel - offset)
                s, e = run.state_start + offset, run.state_start + offset + numel
                g = slice(run.grad_start + offset, run.grad_start + offset + numel)
                update(self.rule, hyper, run.step, state[0][s:e], grad[g], state[1][s:e],
                       None if len(state) == 2 else state[2][s:e], grad_scale=key.scale,
                       out=None if out is None else out[s:e],
                       into=None if spare is None else tuple(t[s:e] for t in spare.state), threads=self.threads,
                       on_host=on_host)
        seconds = time.perf_counter() - start
        self.traffic.add(cpu_update_s=seconds)
        if on_host and spare is None:  # a decided update: what the split weighs against the accelerator's
            total, elements = self._host_timing
            self._host_timing = (total + seconds, elements + sum(run.numel for run in key.runs))

    def take_host_timing(self) -> tuple[float, int] | None:
        """The host's decided updates since the last call: seconds per element and the elements; None if none ran."""
        (seconds, elements), self._host_timing = self._host_timing, (0.0, 0)
        return (seconds / elements, elements) if elements else None

    def _update_from_shards(self, unit: UnitState, key: UpdateKey) -> None:
        """The update of an accelerator unit whose gradient is in FSDP2's shards (`grad_in_shards`): the parameters of
        the runs with the same group and step together (their shards are apart, so a run's contiguity does not bind
        them), in batches of at most `UPDATE_PIECE` elements (a larger parameter alone, in pieces), one fused call a
        batch; `_send` then casts the masters over the shards."""
        state = unit.state
        alike: dict[tuple[int, int], tuple[GroupHyperparams, list[tuple[int, torch.Tensor]]]] = {}
        for run, hyper in zip(key.runs, key.hyper, strict=True):
            pieces = alike.setdefault((run.group_index, run.step), (hyper, []))[1]  # (state offset, gradient piece)
            for param in unit.trained:
                if run.grad_start <= param.slot.offset < run.grad_start + run.numel:
                    grad = param.slot.local.view(-1)
                    pieces += [(param.state_offset + offset, grad[offset : offset + UPDATE_PIECE])
                               for offset in range(0, grad.numel(), UPDATE_PIECE)]
        for (_, step), (hyper, pieces) in alike.items():
            for batch in _batches(pieces, UPDATE_PIECE):
                rows = [slice(s, s + grad.numel()) for s, grad in batch]
                update_many(self.rule, hyper, step, [state[0][r] for r in rows], [grad for _, grad in batch],
                            [state[1][r] for r in rows], None if len(state) == 2 else [state[2][r] for r in rows],
                            grad_scale=key.scale)

    @staticmethod
    def _count_steps(unit: UnitState, used: list[bool]) -> list[TrainedParam]:
        """The parameters the step updated, each counting one more step."""
        updated = [p for p, is_used in zip(unit.trained, used, strict=True) if is_used]
        for param in updated:
            param.step += 1
        return updated

    def _commit(self, unit: UnitState, used: list[bool]) -> None:
        """Make the update the state, then send the updated 16-bit shards to the accelerator."""
        updated = self._count_steps(unit, used)
        if unit.spare is None:  # every trained shard when they held the gradient
            self.send(unit, unit.trained if unit.grad_in_shards else updated, unit.param_staging, non_blocking=True)
            return
        # a kept speculation (it updated every parameter, as the decision does): its state becomes the unit's, and the
        # unit's old state, with the spare's 16-bit copy once it reached the accelerator, the pool's next set
        assert self.scheduler is not None
        returned = unit.swap_spare()
        self.send(unit, updated, returned.out if returned.out is not None else unit.master, non_blocking=True)
        returned.sent = unit.params_copied
        self.scheduler.pool.give_back(returned)

    def send(self, unit: UnitState, params: list[TrainedParam], source: torch.Tensor | None, non_blocking: bool
              ) -> None:
        """Copy the parameters' rows of `source` (laid out as the master) into FSDP2's sharded parameters: from the host
        on a side stream; on the accelerator the master itself, cast, on the training stream after the update."""
        on_host = unit.placement is Placement.HOST
        source = source if on_host else unit.master
        assert source is not None
        stream = self.h2d_stream if on_host else self.compute_stream
        shards = [param.slot.local for param in params]
        rows = [unit.rows(param, source).view_as(shard) for param, shard in zip(params, shards, strict=True)]
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if on_host:  # each its own transfer up, whichever call makes it
                for shard, row in zip(shards, rows, strict=True):
                    shard.copy_(row, non_blocking=non_blocking)
            elif shards:  # the cast: one multi-tensor kernel, not a launch a parameter (torch refuses an empty list)
                torch._foreach_copy_(shards, rows)
        unit.params_copied = record_event(stream)


def _batches(pieces: list[tuple[int, torch.Tensor]], most: int) -> list[list[tuple[int, torch.Tensor]]]:
    """`pieces` (offset, tensor) in order, cut into consecutive batches of at most `most` elements together (a piece
    of `most` or more alone)."""
    batches: list[list[tuple[int, torch.Tensor]]] = []
    elements = most
    for piece in pieces:
        if elements + piece[1].numel() > most:
            batches.append([])
            elements = 0
        batches[-1].append(piece)
        elements += piece[1].numel()
    return batches
