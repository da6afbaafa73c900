"""The accelerator runs a share of the host units' updates (`accelerator_update_share`): after the step's decision, a
lent unit's fp32 master, moments and window gradient go up in pieces, the accelerator updates each piece with the host
kernels' own arithmetic in torch ops (`optim/host_math.py`: the same bits, so which units a step lends changes no
result), writes the updated parameters into FSDP2's shards and sends master and moments back down, while the host's
cores update the other units.

Why: the host's update is paced by its cores' memory bandwidth (0.29 ns per element with fp32 Adam moments on the
16-core H100 box), and a clipped step cannot start it before backward ends, so it is exposed. PCIe beside it carries
55 GB/s each way: a lent element costs 14 B up and 12 B down (fp32 moments, a 16-bit gradient) and no host core.
`update_split.py` chooses which units go, from the measured speed of both sides.

The pieces pass through `LEND_SLOTS` slots planned on the accelerator (`MemoryPlan.lending_bytes`, with one piece's
update workspace: a lent update allocates nothing), on three streams so PCIe works both ways at once: a piece goes up
on `up` once its slot's last piece is back, is updated on `compute`, comes back on `down`. The host keeps the state: a
lent unit's buffers stay its own (pinned at setup where the plan lends: only pinned memory copies without stopping the
thread that queues them); `UnitState.state_back` marks the end of their copy back, which every host reader waits for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from lightning_zoff.offload.fsdp_hooks import record_event
from lightning_zoff.offload.unit_state import TrainedParam, UnitState, UpdateKey, kernel_runs
from lightning_zoff.offload.update_split import UpdateSplit
from lightning_zoff.optim.host_math import update_as_host, workspace_bytes
from lightning_zoff.optim.rules import GroupHyperparams, UpdateRule
from lightning_zoff.placement.plan import LEND_SLOTS, MemoryPlan, Placement

if TYPE_CHECKING:
    from lightning_zoff.offload.decision import Decision


@dataclass
class _Slot:
    """Room on the accelerator for one piece: master, moments and the gradient's bytes (viewed as its dtype)."""

    state: list[torch.Tensor]
    grad_bytes: torch.Tensor  # uint8
    back: torch.cuda.Event | None = None  # the last piece that used it is back on the host


class LentUpdates:
    """Runs host units' updates on `device` in pieces of at most `piece` elements (the plan's `lend_piece`)."""

    def __init__(self, rule: UpdateRule, device: torch.device, *, piece: int, moment_dtype: torch.dtype, moments: int,
                 grad_itemsize: int) -> None:
        self.rule = rule
        self.device = device
        self.piece = piece
        self.grad_itemsize = grad_itemsize  # the widest gradient a slot holds: a unit's wider one stays on the host
        on_cuda = device.type == "cuda"
        self.up = torch.cuda.Stream(device) if on_cuda else None
        self.compute = torch.cuda.Stream(device) if on_cuda else None
        self.down = torch.cuda.Stream(device) if on_cuda else None
        dtypes = [torch.float32] + [moment_dtype] * moments
        self._slots = [_Slot([torch.empty(piece, dtype=d, device=device) for d in dtypes],
                             torch.empty(piece * grad_itemsize, dtype=torch.uint8, device=device))
                       for _ in range(LEND_SLOTS)]
        self._next = 0
        # one piece's update temporaries, carved anew by each update on `compute` (which runs them one at a time)
        self._work = torch.empty(piece * workspace_bytes(moment_dtype.itemsize, moments), dtype=torch.uint8,
                                 device=device)
        # the lent updates of a step, not yet read: (first piece going up, last one back, elements)
        self.timing: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []

    @property
    def nbytes(self) -> int:
        """What the slots and the workspace hold (the plan's `lending_bytes`)."""
        return sum(t.nbytes for slot in self._slots for t in [*slot.state, slot.grad_bytes]) + self._work.nbytes

    @torch.no_grad()
    def update(self, unit: UnitState, key: UpdateKey) -> None:
        """The unit's update for `key` on the accelerator: the host's master and moments are read and written back,
        the updated parameters land in FSDP2's shards of the runs' parameters. Returns once it is queued; records
        `unit.params_copied` (the shards are written) and `unit.state_back` (the host's state is whole again)."""
        grad = unit.window_grad
        assert grad is not None
        first = self._timing_event(self.up)
        _wait(self.up, unit.state_back)  # its last lent update's state is back before it goes up again
        for run, hyper in zip(key.runs, key.hyper, strict=True):
            in_run = [p for p in unit.trained if run.state_start <= p.state_offset < run.state_start + run.numel]
            step = functools.partial(self._step, hyper, run.step, key.scale)
            for offset in range(0, run.numel, self.piece):
                n = min(self.piece, run.numel - offset)
                self._piece(unit, grad, run.state_start + offset, run.grad_start + offset, n, step, in_run)
        unit.params_copied = record_event(self.compute)
        unit.state_back = record_event(self.down)
        last = self._timing_event(self.down)
        if first is not None and last is not None:
            self.timing.append((first, last, sum(run.numel for run in key.runs)))

    def _piece(self, unit: UnitState, grad: torch.Tensor, start: int, grad_start: int, n: int,
               step: Callable[[list[torch.Tensor], torch.Tensor], None], params: list[TrainedParam]) -> None:
        """One piece of `n` elements from state row `start`: up into the next slot with its gradient, `step` on them
        there, the updated parameters into FSDP2's shards of `params`, master and moments back."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        with self._on(self.up):
            _wait(self.up, slot.back)
            state = [s[:n] for s in slot.state]
            for there, here in zip(state, unit.state, strict=True):
                there.copy_(here[start : start + n], non_blocking=True)
            g = slot.grad_bytes[: n * grad.element_size()].view(grad.dtype)
            g.copy_(grad[grad_start : grad_start + n], non_blocking=True)
            loaded = record_event(self.up)
        with self._on(self.compute):
            _wait(self.compute, loaded)
            step(state, g)
            _write_params(unit, params, state[0], start, start + n)
            updated = record_event(self.compute)
        with self._on(self.down):
            _wait(self.down, updated)
            for here, there in zip(unit.state, state, strict=True):
                here[start : start + n].copy_(there, non_blocking=True)
            slot.back = record_event(self.down)

    def _step(self, hyper: GroupHyperparams, step: int, scale: float, state: list[torch.Tensor], grad: torch.Tensor
              ) -> None:
        update_as_host(self.rule, hyper, step, state[0], grad, state[1], None if len(state) == 2 else state[2],
                       grad_scale=scale, work=self._work)

    def take_seconds_per_element(self) -> tuple[float, int] | None:
        """The lent updates queued since the last call, once all ended: seconds from the first piece going up to the
        last coming back, per element, and the elements; None while some run or when none were queued."""
        if not self.timing or not self.timing[-1][1].query():
            return None
        timing, self.timing = self.timing, []
        elements = sum(n for _, _, n in timing)
        return timing[0][0].elapsed_time(timing[-1][1]) / 1e3 / max(1, elements), elements

    def wait(self) -> None:
        """Block until every lent update is back on the host."""
        if self.down is not None:
            self.down.synchronize()

    def _on(self, stream: torch.cuda.Stream | None):  # type: ignore[no-untyped-def]
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    @staticmethod
    def _timing_event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event


def _wait(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
    """Make `stream`'s later work wait for `event` (nothing to wait for on a CPU, where copies are synchronous)."""
    if stream is not None and event is not None:
        stream.wait_event(event)


def _write_params(unit: UnitState, params: list[TrainedParam], master: torch.Tensor, start: int, end: int) -> None:
    """Cast the rows [start, end) of the unit's master (`master` holds exactly those) into FSDP2's shards of the
    parameters whose rows they cover (a parameter's padding has no shard)."""
    for param in params:
        lo, hi = max(start, param.state_offset), min(end, param.state_offset + param.slot.numel)
        if lo < hi:
            local = param.slot.local.view(-1)
            local[lo - param.state_offset : hi - param.state_offset].copy_(master[lo - start : hi - start])


def lent_units(lent: LentUpdates | None, split: UpdateSplit | None,
               take_host_timing: Callable[[], tuple[float, int] | None], order: list[UnitState], decision: Decision,
               as_speculated: bool) -> dict[UnitState, int]:
    """The host units whose update the accelerator runs this step (`update_split.py` chooses, from the host's timing
    and the lent updates' own, both taken here), with the elements each updates, in forward `order`: of those the
    decision updates, not those a kept speculation updated already. None where nothing is lent or the step skips."""
    if lent is None or split is None or decision.skipped:
        return {}
    split.observed(host=take_host_timing(), lent=lent.take_seconds_per_element())
    candidates = {unit: sum(run.numel for run in kernel_runs(unit.trained, decision.used[unit])) for unit in order
                  if unit.placement is Placement.HOST and unit.window_grad is not None
                  and unit.window_grad.element_size() <= lent.grad_itemsize
                  and not (as_speculated and unit.speculation is not None)}
    names = split.choose([(unit.layout.name, elements) for unit, elements in candidates.items()])
    return {unit: elements for unit, elements in candidates.items() if unit.layout.name in names}


def fit_lending(plan: MemoryPlan, lent: LentUpdates | None, split: UpdateSplit | None, *, rule: UpdateRule,
                device: torch.device, moment_dtype: torch.dtype, state_pinned: bool
                ) -> tuple[MemoryPlan, LentUpdates | None, UpdateSplit | None]:
    """The plan, the slots for the lent updates as it has them (none where it lends nothing) and the split, given the
    current `lent` and `split` (kept where they still fit). A GPU's plan loses its share where the host's state is
    not pinned (`state_pinned`: the OS refused; `host_empty` warned): pageable copies would stop the worker at each
    piece."""
    piece = plan.lend_piece
    if lent is not None and lent.piece == piece:
        return plan, lent, split
    if piece and device.type == "cuda" and not state_pinned:
        plan = replace(plan, options=replace(plan.options, update_share="none"))
        piece = 0
    if not piece:
        return plan, None, None
    options = plan.options
    lent = LentUpdates(rule, device, piece=piece, moments=options.moments, moment_dtype=moment_dtype,
                       grad_itemsize=options.lent_grad_bytes)
    if split is None:  # the host reads and writes the state, reads the gradient, writes the 16-bit copy
        state, grad = options.state_bytes(1), options.lent_grad_bytes
        split = UpdateSplit(options.update_share, host_bytes=2 * state + grad + options.param_bytes,
                            up_bytes=options.lend_slot_bytes(1))
    return plan, lent, split
