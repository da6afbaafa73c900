"""How zoff's ranks start, and what reaches the main process when they end.

The multiprocessing launcher (fork/spawn/forkserver) hands back the run's state and metrics, the trained fp32 weights
only when asked (``ZoffStrategy(weights_to_main_process=True)``), a rank's exception as that exception, and, when the
OS kills a rank, how much memory it had used. The subprocess launcher (Lightning's default) has each node's first
failing rank print its error, and no other (`rank_errors`). Both launchers refuse what zoff cannot run before any rank
starts.
"""

from __future__ import annotations

import functools
import inspect
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from lightning.pytorch.trainer.states import TrainerFn
from torch.multiprocessing import ProcessExitedException
from typing_extensions import override

from lightning_zoff._compat_lightning import (
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    WorkerOutput,
    launcher_strategy,
)
from lightning_zoff.checkpoint import files as checkpoint_files
from lightning_zoff.launch.rank_errors import prepare_node
from lightning_zoff.launch.rank_exceptions import raised_as_themselves, run_saving_error
from lightning_zoff.sharding import param_names
from lightning_zoff.trainer.checks import check_configured_optimizers, check_supported
from lightning_zoff.trainer.loops import fabric_step_count

# Set on the main process's LightningModule after a fit whose trained weights stayed in the ranks: it still holds
# the weights it had before that fit. Loading weights into it clears the mark.
_WEIGHTS_IN_RANKS = "_zoff_weights_in_ranks"


class ZoffSubprocessScriptLauncher(SubprocessScriptLauncher):
    """Lightning's default launcher (re-runs the command per rank), checking first what can be checked here."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        _pass_weights_only(trainer, function, args, kwargs)
        if self.cluster_environment.creates_processes_externally:
            # the ranks run already: a later fit or test of a run this launcher started (this process is rank 0 and
            # holds LOCAL_RANK since), or torchrun's, SLURM's. Each rank checks for itself, before its setup.
            _check_before_ranks_start(trainer, function, args, kwargs, optimizers=False)
        else:
            # This process becomes rank 0 and would run configure_optimizers itself: running it here first differs
            # from that only in coming before the other ranks start.
            _check_before_ranks_start(trainer, function, args, kwargs, optimizers=True)
            prepare_node()
        return super().launch(function, *args, trainer=trainer, **kwargs)


class ZoffMultiProcessingLauncher(MultiProcessingLauncher):
    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # not configure_optimizers: with fork, whatever it touched (CUDA) would be the ranks' too
        _pass_weights_only(trainer, function, args, kwargs)
        _check_before_ranks_start(trainer, function, args, kwargs, optimizers=False)
        if trainer is not None:
            _check_weights_current(function, args, kwargs, trainer)
        self._peak_rss: _PeakRss | None = None
        with raised_as_themselves(self._global_rank) as self._error_dir:
            try:
                return super().launch(function, *args, trainer=trainer, **kwargs)
            except ProcessExitedException as err:
                if err.signal_name != "SIGKILL":
                    raise
                raise ProcessExitedException(self._killed_message(err), err.error_index, err.error_pid,
                                             err.exit_code, err.signal_name) from None

    @property
    def procs(self) -> list[Any]:
        return self._procs

    @procs.setter
    def procs(self, procs: list[Any]) -> None:
        # Lightning's launch sets the ranks here right after starting them, then waits for them: the first moment a
        # thread can watch them (a process with threads should not fork)
        self._procs = procs
        if procs:
            self._peak_rss = _PeakRss([p.pid for p in procs])

    @override
    def __getstate__(self) -> dict:
        # spawn pickles the launcher into every rank: not the previous run's processes or its watching thread
        return {**super().__getstate__(), "_procs": [], "_peak_rss": None}

    @override
    def _wrapping_function(self, process_idx: int, *args: Any) -> None:
        wrapped = functools.partial(super()._wrapping_function, process_idx, *args)
        run_saving_error(self._error_dir, process_idx, wrapped)  # for the main process to raise as it is

    def _global_rank(self, process_idx: int) -> int:
        strategy = launcher_strategy(self)
        return strategy.node_rank * strategy.num_processes + process_idx

    def _killed_message(self, err: ProcessExitedException) -> str:
        peaks = self._peak_rss.peaks if self._peak_rss is not None else {}
        mb = 2**20
        used = ", ".join(f"rank {self._global_rank(i)} {peaks[p.pid] / mb:,.0f} MB" for i, p in enumerate(self.procs)
                         if peaks.get(p.pid))
        total = psutil.virtual_memory().total
        return (
            f"rank {self._global_rank(err.error_index)} (pid {err.error_pid}) was killed by SIGKILL: most likely the"
            " host ran out of memory and the kernel's out-of-memory killer stopped it (`dmesg | grep -i oom` shows it"
            " where permitted). Peak resident memory, read every 0.1 s while the ranks ran: "
            + (used or "not readable here (no /proc)")
            + f"; the machine has {total / mb:,.0f} MB in all, shared by every process on it"
            + ". To need less host memory: ZoffStrategy(overlap=False), optimizer_state_dtype='bf16', fewer ranks per"
            " node or more nodes (README: 'What fits')."
        )

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> WorkerOutput | None:
        # Lightning pickles `lightning_module.state_dict()`: sharded DTensors the main process cannot load. Asked for
        # the weights, we gather the fp32 masters instead (a collective: every rank runs it and holds them all).
        strategy = launcher_strategy(self)
        fitted = trainer.state.fn == TrainerFn.FITTING and strategy.engine is not None
        state_dict = strategy.full_state_dict() if fitted and strategy.config.weights_to_main_process else None
        if strategy.local_rank != 0:
            return None
        weights_path = None
        if state_dict is not None:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        return WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))

    @override
    def _recover_results_in_main_process(self, worker_output: WorkerOutput, trainer: Any) -> None:
        module, strategy = trainer.lightning_module, launcher_strategy(self)
        kept = trainer.state.fn == TrainerFn.FITTING and worker_output.weights_path is None
        if kept and not getattr(module, _WEIGHTS_IN_RANKS, False):
            setattr(module, _WEIGHTS_IN_RANKS, True)
            module.register_load_state_dict_post_hook(_weights_loaded)
        # A model built on the meta device (empty_init=True) has no memory to copy the weights into: give it theirs.
        if worker_output.weights_path is not None and any(p.is_meta for p in module.parameters()):
            tied = [names for names in param_names(module).values() if len(names) > 1]
            state = strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
            module.load_state_dict(state, strict=False, assign=True)
            for first, *others in tied:  # assign gave each name a parameter of its own: one again, as built
                for name in others:
                    owner, _, attr = name.rpartition(".")
                    setattr(module.get_submodule(owner), attr, module.get_parameter(first))
            strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
            worker_output = worker_output._replace(weights_path=None)  # loaded: the base class must not again
        super()._recover_results_in_main_process(worker_output, trainer)


def _check_before_ranks_start(trainer: Any, function: Callable, args: Any, kwargs: Any, optimizers: bool) -> None:
    """Refuse here what every rank would: the Trainer's settings and the model (`check_supported`), the optimizer
    (`optimizers`: see `check_configured_optimizers`), a `ckpt_path` that names no checkpoint zoff can load and, to
    resume a fit, one that holds no step count (`fabric_step_count`). The refusal's message says it all, so it comes
    without the frames of the checks."""
    if trainer is None or trainer.lightning_module is None:
        return
    call = inspect.signature(function).bind(*args, **kwargs).arguments
    path = _checkpoint_file(call.get("ckpt_path"))
    try:
        check_supported(trainer, trainer.lightning_module)
        if optimizers and trainer.state.fn == TrainerFn.FITTING:
            check_configured_optimizers(trainer.lightning_module)
        if path is not None:
            checkpoint = checkpoint_files.check_loadable(path, call.get("weights_only"))
            if trainer.state.fn == TrainerFn.FITTING and checkpoint is not None:  # None: a save to recover
                fabric_step_count(checkpoint, path)
    except (ValueError, TypeError, checkpoint_files.CheckpointError) as refusal:
        raise refusal.with_traceback(None) from None


def _pass_weights_only(trainer: Any, function: Callable, args: Any, kwargs: Any) -> None:
    """Hand the strategy the `weights_only` given to fit/validate/test/predict: Lightning passes it to the strategy's
    `load_checkpoint` only where the strategy restores before setup, not zoff's (nor FSDP's, nor DeepSpeed's)."""
    if trainer is not None and hasattr(trainer.strategy, "requested_weights_only"):
        trainer.strategy.requested_weights_only = inspect.signature(function).bind(*args, **kwargs).arguments.get(
            "weights_only")


def _checkpoint_file(ckpt_path: Any) -> Path | None:
    """The local path `ckpt_path` names, or None for none, for the names Lightning resolves itself ("best", "last",
    "hpc", a model registry's) and for a URL."""
    if ckpt_path is None:
        return None
    name = str(ckpt_path)
    if name in ("best", "last", "hpc") or name.lower().split(":")[0] == "registry" or "://" in name:
        return None
    return Path(name)


def _check_weights_current(function: Callable, args: Any, kwargs: Any, trainer: Any) -> None:
    """Refuse to run a module whose trained weights stayed in the ranks of an earlier fit: it would silently continue
    from (or evaluate) the weights it had before that fit. A checkpoint to load, or no module given (Lightning then
    loads the best checkpoint), is fine."""
    call = inspect.signature(function).bind(*args, **kwargs).arguments
    module = call.get("model")
    if module is None or not getattr(module, _WEIGHTS_IN_RANKS, False) or call.get("ckpt_path") is not None:
        return
    if trainer.ckpt_path is not None:  # set by the user (`trainer.ckpt_path = ...`): Lightning loads it
        return
    fn = trainer.state.fn.value if trainer.state.fn is not None else "run"
    raise RuntimeError(
        f"{type(module).__name__} was trained by an earlier fit whose ranks kept the trained weights"
        " (ZoffStrategy(weights_to_main_process=False), the default): this process still holds the weights it had"
        f" before that fit. Pass `{fn}(..., ckpt_path=...)` with a checkpoint of that fit (a path, or 'best' with a"
        " ModelCheckpoint), load the trained weights into the module (`load_state_dict`), or fit with"
        " ZoffStrategy(weights_to_main_process=True)."
    )


def _weights_loaded(module: Any, incompatible_keys: Any) -> None:
    module.__dict__.pop(_WEIGHTS_IN_RANKS, None)


class _PeakRss(threading.Thread):
    """Reads each process's peak resident memory (VmHWM) every 0.1 s while it lives: once the OS has killed one, the
    last reading says what it had used (a killed process leaves no figure behind to ask for)."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(name="zoff-peak-rss", daemon=True)
        self.peaks = dict.fromkeys(pids, 0)
        self.start()

    @override
    def run(self) -> None:
        while any([self._read(pid) for pid in self.peaks]):  # noqa: C419  a list: read every process, not up to the first
            time.sleep(0.1)

    def _read(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        self.peaks[pid] = max(self.peaks[pid], int(line.split()[1]) * 1024)
                        return True
        except OSError:
            pass
        return False  # gone, or a zombie (no memory left to read)
