"""Fabric's forked or spawned ranks (`start_method` "fork", "spawn", "forkserver") with a rank's exception raised in
the main process as itself (`launch/rank_exceptions.py`), as the Trainer's launcher does: `fabric.launch(...)` then
raises a plan's refusal as `PlanDoesNotFit`, not torch's `ProcessRaisedException` holding its text."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from lightning_zoff._compat_lightning import FabricMultiProcessingLauncher
from lightning_zoff.launch.rank_exceptions import raised_as_themselves, run_saving_error


class ZoffFabricMultiProcessingLauncher(FabricMultiProcessingLauncher):
    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        with raised_as_themselves(self._global_rank) as self._error_dir:
            return super().launch(function, *args, **kwargs)

    @override
    def _wrapping_function(self, process_idx: int, *args: Any) -> None:
        wrapped = functools.partial(super()._wrapping_function, process_idx, *args)
        run_saving_error(self._error_dir, process_idx, wrapped)  # for the main process to raise as it is

    def _global_rank(self, process_idx: int) -> int:
        strategy = self._strategy
        return strategy.node_rank * len(strategy.parallel_devices or ()) + process_idx
