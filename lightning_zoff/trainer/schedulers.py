"""LR schedulers that stand still when the optimizer step was skipped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class SkipAwareScheduler:
    """Forwards everything to `scheduler`, except that `step()` does nothing right after a skipped optimizer step
    (fp16 overflow, non-finite gradient): the schedule's position counts real updates only, so a skipped step
    changes nothing at all. Lightning steps it through its `lr_scheduler_configs`; checkpoints save the real
    scheduler's `state_dict`."""

    def __init__(self, scheduler: Any, step_was_skipped: Callable[[], bool]) -> None:
        self._scheduler = scheduler
        self._step_was_skipped = step_was_skipped

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self._step_was_skipped():
            self._scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)
