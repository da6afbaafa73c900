"""Fabric's forked or spawned ranks (`start_method` "fork", "spawn", "forkserver") with a rank's exception raised in
the main process as itself (`launch/rank_exceptions.py`), as the Trainer's launcher does: `fabric.launch(...)` then
raises a plan's refusal as `PlanDoesNotFit`, not torch's `ProcessRaisedException` holding its text."""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from torch.multiprocessing import ProcessRaisedException
from typing_extensions import override

from lightning_zoff._compat_lightning import FabricMultiProcessingLauncher
from lightning_zoff.launch.rank_exceptions import raise_saved, run_saving_error


class ZoffFabricMultiProcessingLauncher(FabricMultiProcessingLauncher):
    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        self._error_dir = tempfile.mkdtemp(prefix="zoff-errors-")
        try:
            return super().launch(function, *args, **kwargs)
        except ProcessRaisedException as err:
            strategy = self._strategy
            ranks_per_node = len(strategy.parallel_devices or ())
            raise_saved(self._error_dir, err, strategy.node_rank * ranks_per_node + err.error_index)
        finally:
            shutil.rmtree(self._error_dir, ignore_errors=True)

    @override
    def _wrapping_function(self, process_idx: int, *args: Any) -> None:
        wrapped = functools.partial(super()._wrapping_function, process_idx, *args)
        run_saving_error(self._error_dir, process_idx, wrapped)  # for the main process to raise as it is
