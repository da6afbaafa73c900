"""ZoffStrategy: Lightning glue for ZeRO-3 sharding (FSDP2) with the optimizer on the CPU. No tensor math here."""

from __future__ import annotations

import logging
import os
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_zoff import checkpoint_files
from lightning_zoff._compat import distributed_is_initialized, init_dist_connection, sync_ddp_if_available
from lightning_zoff.checkpoint import (
    apply_weights, finish_restore, fill_from_full, full_optimizer_state, full_state_dict, sharded_model_state,
    sharded_optimizer_state, state_mesh, unmatched_keys, weight_targets,
)
from lightning_zoff.cpus import CpuLayout, apply_layout, plan_layout, torch_threads
from lightning_zoff.launchers import ZoffMultiProcessingLauncher, ZoffSubprocessScriptLauncher
from lightning_zoff.malloc import fix_mmap_threshold
from lightning_zoff.node_log import log_for_node, speak_for_node
from lightning_zoff.offload import OffloadEngine, StepOutcome, describe_memory
from lightning_zoff.precision import ZoffPrecision
from lightning_zoff.pretrained import read_weights, to_module_names
from lightning_zoff.schedulers import SkipAwareScheduler
from lightning_zoff.telemetry import StepTimer
from lightning_zoff.sharding import ParamInitFn, checkpoint_activations, is_sharded, plan_units, shard_model

log = logging.getLogger("lightning_zoff")

StartMethod = Literal["subprocess", "fork", "spawn", "forkserver"]
_ACCUM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _check_option_types(cpu_threads: Any, **flags: Any) -> None:
    # Hydra and YAML pass what the user typed; `offload=no` must not become True by being a non-empty string.
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"ZoffStrategy({name}={value!r}): expected true or false.")
    if cpu_threads is not None and (isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or cpu_threads < 1):
        raise TypeError(f"ZoffStrategy(cpu_threads={cpu_threads!r}): expected a positive integer, or None for the cores"
                        " this process may use divided by the ranks on its node.")


class ZoffStrategy(ParallelStrategy):
    """ZeRO-3 training: FSDP2 shards parameters on the accelerator; fp32 master and optimizer state live per rank
    on the host (``offload=True``) or on the accelerator (``offload=False``).

    Args:
        offload: keep the fp32 master weights and optimizer state in host memory and run the update on the CPU.
        wrap_policy: module classes that become FSDP2 units; default: the repeated children of `nn.ModuleList`s.
        activation_checkpointing_policy: module classes whose activations are recomputed in backward instead of
            kept (torch's composable `checkpoint`, applied before sharding; parameter names do not change).
        start_method: ``"subprocess"`` re-runs the script per rank (Lightning's default); ``"fork"``/``"spawn"``
            start ranks with multiprocessing (fork is the fast choice for CPU tests).
        weights_to_main_process: with ``"fork"``/``"spawn"``/``"forkserver"``: after ``fit``, gather the trained fp32
            weights and load them into the main process's LightningModule, as Lightning's DDP does. Off by default:
            every rank then holds the whole model next to its optimizer state, the very memory a model needs zoff
            for. Without them the main process gets the run's state and metrics; a later fit, validate, test or
            predict of that module there must load a checkpoint (``ckpt_path=``) and is refused otherwise. With
            ``"subprocess"`` the main process is rank 0 and keeps its trained shards.
        pin_memory: pin host buffers (falls back to pageable memory with a warning when the OS refuses).
        grad_accum_dtype: dtype of the host sum of an accumulation window: ``"fp32"`` (exact for 16-bit
            micro-gradients) or the model's 16-bit dtype (``"bf16"``/``"fp16"``: half the host bytes).
        optimizer_state_dtype: dtype of the optimizer's moments (Adam's exp_avg and exp_avg_sq, Lion's exp_avg):
            ``"fp32"`` or ``"bf16"`` (2 B each instead of 4: 4 B/param less host memory with Adam, 8 with
            ``overlap``; computed in fp32 and stored rounded to nearest even). The master weights stay fp32.
        grad_accum_on: where that sum lives between micro-batches: ``"host"`` (each micro-batch's 16-bit shard goes
            down and is added on the CPU) or ``"accelerator"`` (a partition-sized buffer there; the host gets the
            sum at the window's end).
        retain_gpu_grad_partition_until_step: with ``grad_accum_on="accelerator"``, keep that buffer on the
            accelerator for the whole window (faster) instead of parking it on the host between micro-batches
            (one partition less of accelerator memory between micro-batches; restored exactly).
        cpu_threads: threads of this rank's CPU optimizer kernels; default: the cores this process may use,
            divided by the ranks on this node.
        overlap: run the host work (summing micro-batches, the update) on a worker thread while the accelerator
            computes: each unit's update starts speculatively as soon as its gradient lands in the window's last
            backward and is kept when the step turns out neither clipped nor skipped (else it is redone exactly);
            each unit's next forward waits only for its own parameters. Same bits as ``overlap=False`` (the
            synchronous path), for 12 B/param more host memory (the spare state the speculation writes into; 8 with
            bf16 moments).
        process_group_backend: default ``"cpu:gloo,cuda:nccl"`` on GPU (host tensors need gloo), ``"gloo"`` on CPU.
        state_dict_type: ``"sharded"``: checkpoints are directories in which every rank writes its own rows of the
            fp32 master weights and optimizer state (torch.distributed.checkpoint), resumable at any world size;
            ``"full"``: one file from rank 0 with whole tensors, loadable without zoff (gathered on every rank).
        param_init_fn: ``callable(module)`` that sets the initial values of a module built on the meta device
            (``trainer.init_module(empty_init=True)``) once zoff gave it memory, a unit at a time. Default: the
            LightningModule's ``init_module_weights(module)`` if it has one, else Hugging Face's ``_init_weights``
            for modules of a transformers model, else the module's ``reset_parameters()``.
    """

    strategy_name = "zoff"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        *,
        offload: bool = True,
        wrap_policy: set[type[nn.Module]] | list[type[nn.Module]] | None = None,
        activation_checkpointing_policy: set[type[nn.Module]] | list[type[nn.Module]] | None = None,
        start_method: StartMethod = "subprocess",
        weights_to_main_process: bool = False,
        pin_memory: bool = True,
        grad_accum_dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
        optimizer_state_dtype: Literal["fp32", "bf16"] = "fp32",
        grad_accum_on: Literal["host", "accelerator"] = "host",
        cpu_threads: int | None = None,
        retain_gpu_grad_partition_until_step: bool = False,
        overlap: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        param_init_fn: ParamInitFn | None = None,
    ) -> None:
        if start_method not in ("subprocess", "fork", "spawn", "forkserver"):
            raise ValueError(f"start_method={start_method!r}; choose 'subprocess', 'fork', 'spawn' or 'forkserver'.")
        _check_option_types(offload=offload, pin_memory=pin_memory, weights_to_main_process=weights_to_main_process,
                            retain_gpu_grad_partition_until_step=retain_gpu_grad_partition_until_step,
                            cpu_threads=cpu_threads)
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.offload = bool(offload)
        self.wrap_policy = set(wrap_policy) if wrap_policy else None
        self.activation_checkpointing_policy = set(activation_checkpointing_policy or ())
        self.start_method = start_method
        self.weights_to_main_process = weights_to_main_process
        self.pin_memory = bool(pin_memory)
        if grad_accum_dtype not in _ACCUM_DTYPES:
            raise ValueError(f"grad_accum_dtype={grad_accum_dtype!r}; choose one of {sorted(_ACCUM_DTYPES)}.")
        self.grad_accum_dtype = grad_accum_dtype
        if optimizer_state_dtype not in _MOMENT_DTYPES:
            raise ValueError(f"optimizer_state_dtype={optimizer_state_dtype!r}; choose 'fp32' or 'bf16' (the moments"
                             " in 2 bytes each instead of 4; the master weights stay fp32).")
        self.optimizer_state_dtype = optimizer_state_dtype
        if grad_accum_on not in ("host", "accelerator"):
            raise ValueError(f"grad_accum_on={grad_accum_on!r}; choose 'host' or 'accelerator'.")
        self.grad_accum_on = grad_accum_on
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(f"state_dict_type={state_dict_type!r}; choose 'sharded' or 'full'.")
        self.state_dict_type = state_dict_type
        if param_init_fn is not None and not callable(param_init_fn):
            raise TypeError(f"ZoffStrategy(param_init_fn={param_init_fn!r}): expected a callable(module), or None.")
        self.param_init_fn = param_init_fn
        self._state_mesh: Any = None
        self.cpu_threads = cpu_threads
        self.retain_gpu_grad_partition_until_step = bool(retain_gpu_grad_partition_until_step)
        self.overlap = bool(overlap)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self.engine: OffloadEngine | None = None
        self._units: list[tuple[str, nn.Module]] = []
        self._masters: dict[int, torch.Tensor] = {}
        self._in_optimizer_step = False
        self.last_step: StepOutcome | None = None
        self.telemetry: dict[str, float] = {}
        self._cpu_layout: CpuLayout | None = None
        self._timer = StepTimer(torch.device("cpu"))

    # -- precision: whatever the `precision=` flag built becomes a ZoffPrecision ----------------------------

    @property
    def precision_plugin(self) -> ZoffPrecision:
        return self._precision_plugin if self._precision_plugin is not None else ZoffPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZoffPrecision):
            plugin = ZoffPrecision(getattr(plugin, "precision", "32-true"))
        self._precision_plugin = plugin

    # -- processes and devices ------------------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Lightning adds the DistributedSampler and syncs `self.log(sync_dist=True)` only when this is True.
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str:
        if self._process_group_backend is None:
            self._process_group_backend = "cpu:gloo,cuda:nccl" if self.root_device.type == "cuda" else "gloo"
        return self._process_group_backend

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self.start_method == "subprocess":
            self._launcher = ZoffSubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = ZoffMultiProcessingLauncher(self, start_method=self.start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        init_dist_connection(self.cluster_environment, self.process_group_backend, timeout=self._timeout)
        speak_for_node(self.local_rank)
        on_gpu = self.root_device.type == "cuda"
        self._cpu_layout = self._plan_cpu_layout()
        if on_gpu and self.offload:
            # each rank of the node on its own cores, torch's pool shrunk to what the kernels leave (on CPU
            # machines torch's threads do the training itself, so they keep the process's cores)
            apply_layout(self._cpu_layout)
            binding = "bound to these cores"
        elif on_gpu:
            binding = "not bound to these cores: the optimizer runs on the accelerator (offload=False)"
        else:
            binding = (f"not bound to these cores: the model trains on the CPU, so zoff leaves the process's cores and"
                       f" torch's threads ({torch.get_num_threads()} now) as they are; this share sizes only the"
                       f" optimizer's threads")
        log.debug("zoff rank %d (local %d of %d): %s; %s", self.global_rank, self.local_rank, self.num_processes,
                  self._cpu_layout.describe(), binding)
        if self.root_device.type == "cpu":
            fix_mmap_threshold()  # FSDP2's buffers are host memory here: keep them from piling up in the heap

    # -- model and optimizer --------------------------------------------------------------------------------

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # `trainer.init_module(empty_init=True)`: build on the meta device; `setup` materialises and initialises
        # one unit at a time while sharding, so no rank ever holds the whole model
        if empty_init:
            with torch.device("meta"):
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self._check_supported(trainer, module)
        self._check_accum_dtype()
        self.precision_plugin.device_type = self.root_device.type
        self._timer = StepTimer(self.root_device)
        if not is_sharded(module):
            self._close_engine()  # an earlier fit's, of another model
            self._units = plan_units(module, self.wrap_policy)
            checkpoint_activations(module, self.activation_checkpointing_policy)
            mesh = init_device_mesh(self.root_device.type, (self.world_size,))
            with torch_threads(len(self._cpu_layout.cores)):  # meta init and master copies: no kernels run yet
                self._masters = shard_model(module, self._units, mesh, self.precision_plugin.param_dtype,
                                            self.param_init_fn)
            module.to(self.root_device)  # buffers and anything FSDP2 did not move
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # FSDP2's unsharded parameters must not become inference tensors, or a later fit cannot use them.
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            loop.inference_mode = False

    def _check_supported(self, trainer: Any, module: Any) -> None:
        if not module.automatic_optimization:
            raise ValueError(
                "strategy='zoff' supports automatic optimization only: the optimizer step runs inside the"
                " strategy. Remove `self.automatic_optimization = False` or use another strategy."
            )
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
            raise ValueError(
                "strategy='zoff' clips gradients by norm only; use gradient_clip_algorithm='norm' (the default)."
            )

    def _check_accum_dtype(self) -> None:
        # The window's gradient sum lives on the host in fp32, or in the model's own 16-bit dtype (half the bytes,
        # rounded at every micro-batch); another dtype would round differently from both.
        param_dtype = self.precision_plugin.param_dtype
        valid = sorted({"fp32"} | {name for name, dtype in _ACCUM_DTYPES.items() if dtype == param_dtype})
        if self.grad_accum_dtype not in valid:
            raise ValueError(
                f"grad_accum_dtype={self.grad_accum_dtype!r} cannot accumulate gradients of a"
                f" {self.precision_plugin.precision} model; choose one of {valid}."
            )

    def setup_optimizers(self, trainer: Any) -> None:
        one_optimizer = (
            "strategy='zoff' drives exactly one optimizer; configure_optimizers returned {}. Put all parameters in"
            " one optimizer, using param groups for different settings."
        )
        try:
            super().setup_optimizers(trainer)
        except RuntimeError as err:
            # Lightning's own message points at manual optimization, which zoff does not support.
            if "multiple optimizers" in str(err):
                raise ValueError(one_optimizer.format("several")) from err
            raise
        if len(self.optimizers) != 1:
            raise ValueError(one_optimizer.format(len(self.optimizers)))
        if self.engine is not None:
            # As under every Lightning strategy, a new fit steps the optimizer configure_optimizers just returned, from
            # fresh state (a resume with ckpt_path restores it later, in load_checkpoint); the fp32 masters carry over.
            self._masters = self.engine.fp32_shards()
            self._close_engine()
        state_device = torch.device("cpu") if self.offload else self.root_device
        threads = self._optimizer_threads()
        with torch_threads(max(torch.get_num_threads(), threads)):  # the host state's first copies
            self.engine = self._build_engine(state_device, threads, trainer.accumulate_grad_batches)
        self.engine.attach()
        self._masters = {}
        self._log_memory()
        for config in self.lr_scheduler_configs:
            if config.interval == "step" and not isinstance(config.scheduler, SkipAwareScheduler):
                config.scheduler = SkipAwareScheduler(config.scheduler, self._last_step_skipped)

    def _close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _build_engine(self, state_device: torch.device, threads: int, accumulate_grad_batches: int) -> OffloadEngine:
        return OffloadEngine(
            self._units, self._masters, self.optimizers[0],
            world_size=self.world_size, state_device=state_device, pin_memory=self.pin_memory,
            grad_accum_dtype=_ACCUM_DTYPES[self.grad_accum_dtype],
            moment_dtype=_MOMENT_DTYPES[self.optimizer_state_dtype], accumulate_grad_batches=accumulate_grad_batches,
            accumulate_on_accelerator=self.grad_accum_on == "accelerator",
            retain_device_sum=self.retain_gpu_grad_partition_until_step, threads=threads, overlap=self.overlap,
            ranks_on_node=self.num_processes,
        )

    def _log_step(self, loss_scale: float) -> None:
        # Lightning allows logging from `optimizer_step`; its loggers keep their own cadence
        assert self.engine is not None and self.last_step is not None
        traffic = self.engine.take_traffic()
        # on CUDA the phase times come a step late (see StepTimer); the gate's wait travels with its own window
        times = self._timer.end_window(gate_wait=self.engine.take_gate_wait())
        metrics = {}
        if times is not None:
            # forwards that waited for an overlapped update: that wait is exposed optimizer time, not forward time
            gate_wait = times.pop("gate_wait")
            times["forward"] = times.get("forward", 0.0) - gate_wait
            times["exposed_optimizer"] = times.get("exposed_optimizer", 0.0) + gate_wait
            metrics = {f"zoff/{phase}_s": seconds for phase, seconds in times.items()}
        metrics |= {
            # cpu_update_s: update kernels that finished since the last step (overlapped ones may end a step late)
            "zoff/cpu_update_s": traffic.cpu_update_s, "zoff/d2h_gb": traffic.d2h_bytes / 1e9,
            "zoff/h2d_gb": traffic.h2d_bytes / 1e9, "zoff/grad_norm": self.last_step.grad_norm,
            "zoff/skipped": float(self.last_step.skipped), "zoff/loss_scale": loss_scale,
            "zoff/speculations_kept": float(traffic.speculations_kept),
            "zoff/speculations_redone": float(traffic.speculations_redone),
        }
        self.telemetry = metrics  # the last step's, for callbacks and benchmarks
        self.lightning_module.log_dict(metrics, on_step=True, on_epoch=False)

    def _last_step_skipped(self) -> bool:
        return self.last_step is not None and self.last_step.skipped

    def _optimizer_threads(self) -> int:
        if self._cpu_layout is None:  # setup_environment did not run (a strategy driven by hand)
            self._cpu_layout = self._plan_cpu_layout()
        return self._cpu_layout.kernel_threads

    def _plan_cpu_layout(self) -> CpuLayout:
        return plan_layout(sorted(os.sched_getaffinity(0)), self.local_rank, self.num_processes, self.cpu_threads)

    def _log_memory(self) -> None:
        assert self.engine is not None
        self.memory_report = self.engine.memory_report()
        line = f"{self.engine.threads} CPU threads for the optimizer; memory: {describe_memory(self.memory_report)}"
        log_for_node(line, self.global_rank, self.local_rank, self.num_processes)

    # -- the training step ----------------------------------------------------------------------------------

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.engine is not None
        self.engine.begin_backward(window_ends=self._in_optimizer_step, loss_scale=self.precision_plugin.loss_scale)
        with self._timer.measure("backward"):
            closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
            self.engine.after_backward()
        return closure_loss

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._timer.measure("forward"):
            return super().training_step(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # Lightning's precision plugin runs the closure (forward, backward, clipping hook) through
        # `optimizer.step(closure)`. The engine took every gradient in backward, so torch's own step sees none and
        # changes nothing; the update is the engine's.
        # Lightning runs the window's last backward inside this call, the others outside it.
        self._in_optimizer_step = True
        try:
            result = super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            self._in_optimizer_step = False
        assert self.engine is not None
        precision = self.precision_plugin
        # with overlap this waits for the window's last gradients to land and decides; without, it also updates
        with self._timer.measure("exposed_optimizer"):
            self.last_step = self.engine.step(optimizer, precision.take_clip_request(), precision.loss_scale)
        if precision.scaler is not None:
            precision.scaler.update(overflow=self.last_step.skipped)
        self._log_step(precision.loss_scale)
        if self.last_step.skipped:
            log.warning("zoff: non-finite gradient (norm %s) at step %d: step skipped, nothing changed%s",
                        self.last_step.grad_norm, self.lightning_module.trainer.global_step,
                        f"; loss scale now {precision.loss_scale:g}" if precision.scaler is not None else "")
        return result

    # -- checkpoints: every method here is a collective -----------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # fp32 masters once the engine exists (views of this rank's rows when sharded); before, the model's shards
        if self.engine is None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = self.state_dict_type == "full"
            return get_model_state_dict(self.lightning_module, options=StateDictOptions(full_state_dict=full, cpu_offload=full))
        self.engine.wait_idle()
        if self.state_dict_type == "full":
            return full_state_dict(self.lightning_module, self.engine)
        return sharded_model_state(self.lightning_module, self.engine, self._mesh())

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self.engine is None:
            return super().optimizer_state(optimizer)
        self.engine.wait_idle()
        if self.state_dict_type == "full":
            return full_optimizer_state(self.lightning_module, self.engine, optimizer)
        return sharded_optimizer_state(self.lightning_module, self.engine, optimizer, self._mesh())

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("strategy='zoff' writes checkpoints itself and takes no storage_options.")
        path = Path(self.broadcast(str(filepath)))  # every rank writes where rank 0 says
        checkpoint["zoff"] = checkpoint_files.zoff_info(checkpoint["state_dict"], self.state_dict_type, self.world_size)
        if self.state_dict_type == "sharded":
            checkpoint_files.save_sharded(checkpoint, path, self.global_rank, self.barrier)
        elif self.is_global_zero:
            checkpoint_files.save_full(checkpoint, path)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            checkpoint_files.remove(Path(filepath))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Restores the weights (and, when fitting, the optimizer state) right here; Lightning restores the rest
        # (loops, LR schedulers, callbacks, loss scaler) from the dict returned.
        path = Path(self.broadcast(str(checkpoint_path)))
        if self.is_global_zero:
            checkpoint_files.recover(path)
        self.barrier()
        module = self.lightning_module
        checkpoint = checkpoint_files.read(path, weights_only)
        expected = {name: list(t.shape) for name, t in module.state_dict().items()}
        checkpoint_files.check_compatible(checkpoint, path, expected)
        if self.engine is None:
            targets = {"state_dict": weight_targets(module)}
            self._read_tensors(path, checkpoint, targets)
            apply_weights(module, targets["state_dict"], self._masters)
            return checkpoint
        self.engine.wait_idle()
        targets = {"state_dict": sharded_model_state(module, self.engine, self._mesh())}
        optimizer, optimizer_state = None, None
        if module.trainer.state.fn == TrainerFn.FITTING and "optimizer_states" in checkpoint:
            optimizer = self.optimizers[0]
            optimizer_state = sharded_optimizer_state(module, self.engine, optimizer, self._mesh())
            optimizer_state["param_groups"] = checkpoint["optimizer_states"][0]["param_groups"]
            targets["optimizer_0"] = optimizer_state["state"]
        self._read_tensors(path, checkpoint, targets)
        finish_restore(module, self.engine, targets["state_dict"], optimizer, optimizer_state)
        return checkpoint

    def _read_tensors(self, path: Path, checkpoint: dict[str, Any], targets: dict[str, Any]) -> None:
        if path.is_dir():
            checkpoint_files.load_sharded(path, targets)
            return
        full = {"state_dict": checkpoint["state_dict"]}
        if "optimizer_0" in targets:
            full["optimizer_0"] = checkpoint["optimizer_states"][0]["state"]
        fill_from_full(targets, full, self.world_size, self.global_rank)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint

    def _mesh(self) -> Any:
        assert self.engine is not None
        if self._state_mesh is None:
            self._state_mesh = state_mesh(self.engine)
        return self._state_mesh

    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor] | str | Path, strict: bool = True, prefix: str | None = None
    ) -> None:
        """Load whole (unsharded) weights, such as a pretrained model's, into the sharded model: every rank copies
        only its own rows into its fp32 master and refreshes its 16-bit shards. Call it once the strategy is set up
        (for example in `on_fit_start`).

        `state_dict` is a dict of tensors or a path: a directory written by Hugging Face `save_pretrained`
        (model.safetensors, sharded with model.safetensors.index.json, or pytorch_model.bin), a .safetensors file
        (a rank reads only its rows), or a torch.save file such as a .pt, .bin or Lightning .ckpt (memory-mapped).
        `prefix` goes before every name of the weights to give the LightningModule's (``"model."`` for a Hugging Face
        model held as ``self.model``); by default the prefix (none, or a submodule's name) under which the most names
        match. `strict=False` loads the names that match, but refuses weights of which none do."""
        if self.engine is None:
            raise RuntimeError("load_full_state_dict needs the sharded model and its optimizer state: call it once"
                               " fit has set up the strategy (for example in `on_fit_start`).")
        if isinstance(state_dict, (str, Path)):
            state_dict = read_weights(state_dict)
        self.engine.wait_idle()
        module = self.lightning_module
        targets = sharded_model_state(module, self.engine, self._mesh())
        state_dict, prefix = to_module_names(state_dict, targets.keys(), module, prefix)
        missing, unexpected = unmatched_keys(module, targets, state_dict)
        if strict and (missing or unexpected):
            renamed = f", the weights' names prefixed with {prefix!r}" if prefix else ""
            raise KeyError(f"load_full_state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}"
                           f" ({len(missing)} and {len(unexpected)}{renamed}); pass strict=False to load the keys that"
                           " match.")
        fill_from_full({k: v for k, v in targets.items() if k in state_dict}, state_dict, self.world_size,
                       self.global_rank)
        finish_restore(module, self.engine, targets, None, None)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The LightningModule's state dict with fp32 master weights, on every rank (a collective)."""
        assert self.engine is not None
        self.engine.wait_idle()
        return full_state_dict(self.lightning_module, self.engine)

    def process_dataloader(self, dataloader: Any) -> Any:
        # Lightning's predict sampler does not repeat samples, so ranks can get different batch counts; a sharded
        # forward then waits forever for the rank that ran out. Refuse before that happens.
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        sampler = getattr(batch_sampler, "sampler", None)
        if isinstance(sampler, UnrepeatedDistributedSamplerWrapper) and distributed_is_initialized():
            counts = [None] * self.world_size
            dist.all_gather_object(counts, len(dataloader))
            if len(set(counts)) > 1:
                raise ValueError(
                    f"zoff: the predict dataloader gives ranks different batch counts {counts}; every rank must"
                    f" run the same number of sharded forwards. Pad the dataset to a multiple of"
                    f" world_size x batch_size ({self.world_size} x {dataloader.batch_size})."
                )
        return dataloader

    # -- collectives ----------------------------------------------------------------------------------------

    def barrier(self, name: str | None = None) -> None:
        if distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        if self.engine is not None:
            # its thread ends and its hooks go; its state stays for trainer.save_checkpoint and leaves with the Trainer
            self.engine.detach()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "zoff", cls, description="ZeRO-3 (FSDP2) with the optimizer and fp32 master offloaded to the CPU",
            offload=True,
        )
        strategy_registry.register(
            "zoff_no_offload", cls, description="ZeRO-3 (FSDP2) with the optimizer on the accelerator",
            offload=False,
        )
