"""Multiprocessing launcher that hands the trained fp32 weights, not DTensor shards, back to the main process."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn

from lightning_zoff.checkpoint import param_names


class ZoffMultiProcessingLauncher(_MultiProcessingLauncher):
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> _WorkerOutput | None:
        # The base class pickles `lightning_module.state_dict()`: sharded DTensors the main process cannot load.
        # We gather the fp32 masters instead (a collective, so every rank runs it).
        fitted = trainer.state.fn == TrainerFn.FITTING and self._strategy.engine is not None
        state_dict = self._strategy.full_state_dict() if fitted else None
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if state_dict is not None:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: Any) -> None:
        # A model built on the meta device (empty_init=True) has no memory to copy the weights into: give it theirs.
        module = trainer.lightning_module
        if worker_output.weights_path is not None and any(p.is_meta for p in module.parameters()):
            tied = [names for names in param_names(module).values() if len(names) > 1]
            state = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
            module.load_state_dict(state, strict=False, assign=True)
            for first, *others in tied:  # assign gave each name a parameter of its own: one again, as built
                for name in others:
                    owner, _, attr = name.rpartition(".")
                    setattr(module.get_submodule(owner), attr, module.get_parameter(first))
            self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
            worker_output = worker_output._replace(weights_path=None)  # loaded: the base class must not again
        super()._recover_results_in_main_process(worker_output, trainer)

