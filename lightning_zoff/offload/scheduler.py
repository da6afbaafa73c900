"""When the host work runs with `overlap`: on one background thread, in priority order, beside the accelerator.

Landings come first (the step waits for every unit's sum of squares), then finalizing (the next forward waits for
it), then speculation, which only fills idle time: after a unit's window gradient is complete, its update runs as
if the step will be neither clipped nor skipped, into spare buffers. The step's decision then keeps it (same key)
or redoes the update in place from the untouched state. Without overlap, the engine runs the same functions inline
and there is no scheduler.

Speculation pays only when the step keeps it. While steps are clipped (a large model's early training: every step)
or skipped, each one is redone after the decision anyway, and the host bandwidth it took in backward is lost; so
after such a step the next window does not speculate, and after a step kept as speculated it does again.

Spare buffers come from a `SparePool` of as many sets as the memory plan finds room for on the host (at most one per
two host units: the CPU can only speculate the units whose gradients arrive early in backward anyway); a unit that
finds none free waits for the decision and updates in place, in the order the next forward needs the units, while
that forward goes on.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import torch

from lightning_zoff.offload.unit_state import Phase, UnitState, UpdateKey
from lightning_zoff.offload.worker import HostWorker
from lightning_zoff.placement.mover import SpareSet

_LAND, _FINALIZE, _SPECULATE = 0, 1, 2
# The worker needs the GIL for a moment between kernels; by default Python hands it over only every 5 ms, and a
# unit's landing and update are several calls. Hand it over 10x sooner while a scheduler lives.
_SWITCH_INTERVAL_S = 0.0005


SetSize = tuple[tuple[int, torch.dtype], ...]  # (elements, dtype) of each tensor of a set's state


class SparePool:
    """Sets of spare buffers (`SpareSet`: a unit's state and its 16-bit copy), lent to one speculating unit at a time,
    by size. A kept speculation swaps the set's state with the unit's, and the unit's old state joins the pool. How many
    sets there are is the memory plan's (`MemoryPlan.spare_sets`); `resize` makes or frees them between steps."""

    def __init__(self) -> None:
        self._free: dict[SetSize, list[SpareSet]] = {}
        self.sets = 0  # lent or free
        self.nbytes = 0

    @staticmethod
    def _key(state: list[torch.Tensor]) -> SetSize:
        return tuple((t.numel(), t.dtype) for t in state)

    def resize(self, sets: int, make: Callable[[], SpareSet]) -> None:
        """Make or free sets until there are `sets` (every set must be free: between steps)."""
        while self.sets < sets:
            spare = make()
            self.give_back(spare)
            self.sets += 1
            self.nbytes += sum(t.nbytes for t in spare.buffers())
        while self.sets > sets:
            dropped = next(free for free in self._free.values() if free).pop()
            self.sets -= 1
            self.nbytes -= sum(t.nbytes for t in dropped.buffers())

    def free_buffers(self) -> list[torch.Tensor]:
        return [t for free in self._free.values() for spare in free for t in spare.buffers()]

    def take(self, like: list[torch.Tensor]) -> SpareSet | None:
        """A free set shaped as the state `like`, once the last copy from its 16-bit buffer ended; None if none is
        free."""
        free = self._free.get(self._key(like))
        if not free:
            return None
        spare = free.pop()
        if spare.sent is not None:
            spare.sent.synchronize()  # long done in practice: the forward after that copy waited for it
            spare.sent = None
        return spare

    def give_back(self, spare: SpareSet) -> None:
        self._free.setdefault(self._key(spare.state), []).append(spare)


class HostScheduler:
    def __init__(self, pool: SparePool) -> None:
        self.pool = pool
        self.worker = HostWorker()
        self._switch_interval = sys.getswitchinterval()  # what `close` restores
        sys.setswitchinterval(min(self._switch_interval, _SWITCH_INTERVAL_S))
        self._landings = 0  # handed to the worker and not yet done
        self._landings_lock = threading.Lock()  # counted up in backward's thread, down in the worker
        self.window = 0  # accumulation windows decided so far: a speculation of an older one is stale
        self.speculating = True  # this window speculates: the last step was neither clipped nor skipped
        self.speculations = {"kept": 0, "redone": 0}  # since the start, for tests and logs
        # tests: every window speculates and the decision waits until all of it ran, so both outcomes happen
        self.await_speculation = False

    # -- backward ---------------------------------------------------------------------------------------------

    def land(self, task: Callable[[], None], ready: Callable[[], bool] | None) -> None:
        """Queue a unit's landing; `ready` says when its gradient copy has arrived."""
        with self._landings_lock:
            self._landings += 1
        self.worker.submit(_LAND, task, ready=ready)

    def landed(self) -> None:
        """A landing ended (called by the landing itself, also when it failed)."""
        with self._landings_lock:
            self._landings -= 1
        self.worker.notify()

    def speculate(self, unit: UnitState, key: Callable[[], UpdateKey], update: Callable[[UnitState, UpdateKey], None]
                  ) -> None:
        """Queue the unit's update for the step as it would be if nothing is clipped or skipped (`key()`), unless
        the window is decided before the worker gets to it."""
        window = self.window
        if not (self.speculating or self.await_speculation):
            return

        def task() -> None:
            if window != self.window or unit.phase is not Phase.READY:
                return  # decided already: finalizing does the exact work
            unit.spare = self.pool.take(unit.state)
            if unit.spare is None:
                return  # every set is lent: this unit's update waits for the decision
            speculated = key()
            update(unit, speculated)
            unit.speculation = speculated

        self.worker.submit(_SPECULATE, task)

    # -- step -------------------------------------------------------------------------------------------------

    def wait_for_landings(self) -> None:
        self.worker.wait_until(lambda: self._landings == 0)
        if self.await_speculation:
            self.worker.wait_idle()

    def decided(self, as_speculated: bool) -> None:
        """The window's step is decided: its speculations not yet run are stale. `as_speculated`: it was neither clipped
        nor skipped (a speculation would have been kept), which decides whether the next window speculates."""
        self.window += 1
        self.speculating = as_speculated

    def judge(self, unit: UnitState, key: UpdateKey | None) -> str | None:
        """"kept" when the unit's speculation is the decided update, "redone" when it is not (`key` None: the step
        is skipped), None when there was none; counted in `speculations`. Only a kept one keeps its spare buffers."""
        if unit.speculation is None:
            return None
        outcome = "kept" if unit.speculation == key else "redone"
        self.speculations[outcome] += 1
        if outcome == "redone":
            self.release(unit)
        return outcome

    def release(self, unit: UnitState) -> None:
        """The unit's spare buffers go back to the pool, unused."""
        if unit.spare is not None:
            self.pool.give_back(unit.spare)
            unit.spare = None

    def finalize(self, task: Callable[[], None]) -> None:
        self.worker.submit(_FINALIZE, task)

    # -- forward ----------------------------------------------------------------------------------------------

    def wait_finalized(self, unit: UnitState) -> float:
        """Block until the unit's update is on its way to the accelerator; the seconds it took."""
        if unit.phase is not Phase.FINALIZING:
            return 0.0
        start = time.perf_counter()
        self.worker.wait_until(lambda: unit.phase is not Phase.FINALIZING)
        return time.perf_counter() - start

    def wait_idle(self) -> None:
        self.worker.wait_idle()

    def close(self) -> None:
        """End the thread (dropping queued work: close after `wait_idle`) and restore the switch interval."""
        self.worker.close()
        sys.setswitchinterval(self._switch_interval)
