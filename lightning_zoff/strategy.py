"""ZoffStrategy: Lightning glue for ZeRO-3 sharding (FSDP2) with the optimizer on the CPU; no tensor math. Its options
are a `ZoffConfig`; it owns its `Checkpoints` and its `Memory`, runs each rank through `ranks`, refuses via `checks`."""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from typing_extensions import override

from lightning_zoff import ranks
from lightning_zoff._compat import (
    expandable_cuda_segments,
    set_strategy_launcher,
    set_strategy_precision_plugin,
    strategy_precision_plugin,
)
from lightning_zoff.checks import (
    ONE_OPTIMIZER,
    check_accum_dtype,
    check_optimizers,
    check_predict_batches,
    check_supported,
)
from lightning_zoff.config import ParamInitFn, StartMethod, ZoffConfig
from lightning_zoff.cpus import CpuLayout, torch_threads
from lightning_zoff.launchers import ZoffMultiProcessingLauncher, ZoffSubprocessScriptLauncher
from lightning_zoff.offload import OffloadEngine, StepOutcome
from lightning_zoff.precision import ZoffPrecision
from lightning_zoff.schedulers import SkipAwareScheduler
from lightning_zoff.sharding import checkpoint_activations, forward_order, is_sharded, plan_units, shard_model
from lightning_zoff.strategy_checkpoint import Checkpoints
from lightning_zoff.strategy_memory import Memory
from lightning_zoff.telemetry import StepTimer, step_metrics

log = logging.getLogger("lightning_zoff")


class ZoffStrategy(ParallelStrategy):
    """ZeRO-3 training: FSDP2 shards parameters on the accelerator; fp32 master and optimizer state live per rank on
    the host (``offload=True``), updated by the CPU, or on the accelerator. Each keyword option is a field of
    `ZoffConfig` (`lightning_zoff.config`), which documents and checks it; `self.config` holds them."""

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
        accelerator_state: Literal["auto", "none"] | float = "auto",
        wrap_policy: set[type[nn.Module]] | list[type[nn.Module]] | None = None,
        activation_checkpointing_policy: set[type[nn.Module]] | list[type[nn.Module]] | Literal["auto"] | None = "auto",
        start_method: StartMethod = "subprocess",
        weights_to_main_process: bool = False,
        pin_memory: bool = True,
        grad_accum_dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
        optimizer_state_dtype: Literal["fp32", "bf16"] = "fp32",
        grad_accum_on: Literal["host", "accelerator"] = "host",
        retain_gpu_grad_partition_until_step: bool = False,
        cpu_threads: int | None = None,
        overlap: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        param_init_fn: ParamInitFn | None = None,
    ) -> None:
        options = {name: value for name, value in locals().items() if name in ZoffConfig.__dataclass_fields__}
        self.config = ZoffConfig(**options)
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.num_nodes = 1
        self.engine: OffloadEngine | None = None
        self.checkpoints = Checkpoints(self)
        self.memory = Memory(self)
        self.masters: dict[int, torch.Tensor] = {}  # fp32 shards by id of the parameter, until an engine takes them
        self.last_step: StepOutcome | None = None
        self.telemetry: dict[str, float] = {}  # the last step's, for callbacks and benchmarks
        self._units: list[tuple[str, nn.Module]] = []
        self._in_optimizer_step = False
        self._cpu_layout: CpuLayout | None = None
        self._timer = StepTimer(torch.device("cpu"))

    @property
    def module(self) -> pl.LightningModule:
        """The LightningModule: Lightning connects it before the strategy needs it."""
        module = self.lightning_module
        assert module is not None, "zoff: the strategy has no LightningModule yet"
        return module

    @property
    def memory_report(self) -> dict[str, float]:
        """The engine's memory by kind and side, as last reported (setup, or after "auto" moved state)."""
        return self.memory.report

    # -- precision: whatever the `precision=` flag built becomes a ZoffPrecision ----------------------------

    @property
    @override
    def precision_plugin(self) -> ZoffPrecision:
        plugin = strategy_precision_plugin(self)
        return plugin if plugin is not None else ZoffPrecision("32-true")

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZoffPrecision):
            plugin = ZoffPrecision(getattr(plugin, "precision", "32-true"))
        set_strategy_precision_plugin(self, plugin)

    # -- processes ------------------------------------------------------------------------------------------

    @property
    @override
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
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str:
        return self.config.process_group_backend or ranks.default_backend(self.root_device)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            set_strategy_launcher(self, ZoffSubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                                     self.num_nodes)
                                  if self.config.start_method == "subprocess" else
                                  ZoffMultiProcessingLauncher(self, start_method=self.config.start_method))

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        ranks.set_world_ranks(self.cluster_environment, self.node_rank, self.local_rank, self.num_processes,
                              self.num_nodes)
        assert self.cluster_environment is not None
        self._cpu_layout = ranks.start_rank(
            self.cluster_environment, self.process_group_backend, self.config.timeout, device=self.root_device,
            global_rank=self.global_rank, local_rank=self.local_rank, per_node=self.num_processes,
            cpu_threads=self.config.cpu_threads, offload=self.config.offload)
        if self.root_device.type == "cuda":
            expandable_cuda_segments()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        check_predict_batches(dataloader, self.world_size)
        return dataloader

    @override
    def barrier(self, name: str | None = None) -> None:
        ranks.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return ranks.broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return ranks.reduce(tensor, group, reduce_op)

    # -- model and optimizer --------------------------------------------------------------------------------

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # `trainer.init_module(empty_init=True)`: build on the meta device; `setup` materialises and initialises
        # one unit at a time while sharding, so no rank ever holds the whole model
        if empty_init:
            with torch.device("meta"):
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.module
        check_supported(trainer, module)  # the launchers call it too, before any rank starts
        precision = self.precision_plugin
        check_accum_dtype(self.config.grad_accum_dtype, precision.precision, precision.param_dtype)
        precision.device_type = self.root_device.type
        self._timer = StepTimer(self.root_device)
        if not is_sharded(module):
            self._close_engine()  # an earlier fit's, of another model
            self._units = plan_units(module, self.config.wrap_policy)
            self.memory.read_machine()
            policy = self.config.activation_checkpointing_policy
            recomputed: set[type[nn.Module]] = set() if policy == "auto" else set(policy)
            if trainer.state.fn == TrainerFn.FITTING and self.config.offload:
                recomputed = self.memory.check_before_sharding(module, self._units, trainer.accumulate_grad_batches)
            checkpoint_activations(module, recomputed)
            mesh = init_device_mesh(self.root_device.type, (self.world_size,))
            with torch_threads(len(self._layout().cores)):  # meta init and master copies: no kernels run yet
                self.masters = shard_model(module, self._units, mesh, precision.param_dtype,
                                           self.config.param_init_fn)
            module.to(self.root_device)  # buffers and anything FSDP2 did not move
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # FSDP2's unsharded parameters must not become inference tensors, or a later fit cannot use them.
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            loop.inference_mode = False

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        try:
            super().setup_optimizers(trainer)
        except RuntimeError as err:
            # Lightning's own message points at manual optimization, which zoff does not support.
            if "multiple optimizers" in str(err):
                raise ValueError(ONE_OPTIMIZER.format("several")) from err
            raise
        check_optimizers(self.optimizers)
        if self.engine is not None:
            # As under every Lightning strategy, a new fit steps the optimizer configure_optimizers just returned, from
            # fresh state (a resume with ckpt_path restores it later, in load_checkpoint); the fp32 masters carry over.
            self.masters = self.engine.fp32_shards()
            self._close_engine()
        threads = self._layout().kernel_threads
        machine = self.memory.machine or self.memory.read_machine()  # read at setup, unless the model came sharded
        with torch_threads(max(torch.get_num_threads(), threads)):  # the host state's first copies
            self.engine = OffloadEngine(self._units, self.masters, self.optimizers[0], self.config,
                                        world_size=self.world_size, machine=machine,
                                        accumulate_grad_batches=trainer.accumulate_grad_batches, threads=threads,
                                        forward_order=forward_order(self.module, self._units))
        self.engine.attach()
        self.masters = {}
        self.memory.engine_built(self.engine)
        for config in self.lr_scheduler_configs:
            if config.interval == "step" and not isinstance(config.scheduler, SkipAwareScheduler):
                # steps the wrapped scheduler as Lightning would, minus the skipped steps
                config.scheduler = SkipAwareScheduler(config.scheduler, self._last_step_skipped)  # type: ignore[assignment]

    def _close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _layout(self) -> CpuLayout:
        if self._cpu_layout is None:  # setup_environment did not run (a strategy driven by hand)
            self._cpu_layout = ranks.cpu_layout(self.local_rank, self.num_processes, self.config.cpu_threads)
        return self._cpu_layout

    def _last_step_skipped(self) -> bool:
        return self.last_step is not None and self.last_step.skipped

    # -- the training step ----------------------------------------------------------------------------------

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.engine is not None
        self.engine.begin_backward(window_ends=self._in_optimizer_step, loss_scale=self.precision_plugin.loss_scale)
        with self._timer.measure("backward"), self.memory.explaining_oom():
            closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
            self.engine.after_backward()
        return closure_loss

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._timer.measure("forward"), self.memory.explaining_oom():
            return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # Lightning's precision plugin runs the closure (forward, backward, clipping hook) through
        # `optimizer.step(closure)`. The engine took every gradient in backward, so torch's own step sees none and
        # changes nothing; the update is the engine's.
        # Lightning runs the window's last backward inside this call, the others outside it.
        self._in_optimizer_step = True
        try:
            result = self._run_window_end(optimizer, closure, model, **kwargs)
        finally:
            self._in_optimizer_step = False
        assert self.engine is not None
        precision = self.precision_plugin
        # with overlap this waits for the window's last gradients to land and decides; without, it also updates
        with self._timer.measure("exposed_optimizer"):
            self.last_step = self.engine.step(optimizer, precision.take_clip_request(), precision.loss_scale)
        if precision.scaler is not None:
            precision.scaler.update(overflow=self.last_step.skipped)
        placing = time.perf_counter()
        self.memory.after_step(self.engine)  # "auto" on a GPU: moves by this step's peak, after its host updates
        placement_s = time.perf_counter() - placing
        # on CUDA the phase times come a step late (see StepTimer); the gate's wait travels with its own window
        times = self._timer.end_window(gate_wait=self.engine.take_gate_wait())
        self.telemetry = step_metrics(times, self.engine.take_traffic(), self.last_step.grad_norm,
                                      self.last_step.skipped, precision.loss_scale) | {"zoff/placement_s": placement_s}
        self.module.log_dict(self.telemetry, on_step=True, on_epoch=False)  # Lightning allows it in optimizer_step
        if self.last_step.skipped:
            log.warning("zoff: non-finite gradient (norm %s) at step %d: step skipped, nothing changed%s",
                        self.last_step.grad_norm, self.module.trainer.global_step,
                        f"; loss scale now {precision.loss_scale:g}" if precision.scaler is not None else "")
        return result

    def _run_window_end(self, optimizer: Any, closure: Any, model: Any, **kwargs: Any) -> Any:
        """The window's last forward and backward (Lightning's closure). On one rank, a window of one micro-batch that
        runs the accelerator out of memory runs again once state moved back to the host makes room: nothing was
        applied yet. (Ranks that did not fail would wait in collectives the failed one left: they stop.)"""
        assert self.engine is not None
        while True:
            try:
                return super().optimizer_step(optimizer, closure, model, **kwargs)
            except torch.OutOfMemoryError:
                one_window = self.world_size == 1 and self.module.trainer.accumulate_grad_batches == 1
                if not one_window or not self.memory.make_room_after_oom(self.engine):
                    raise

    # -- checkpoints (`Checkpoints`) ------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.checkpoints.module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        state = self.checkpoints.optimizer_state(optimizer)
        return super().optimizer_state(optimizer) if state is None else state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.checkpoints.save(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpoints.remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self.checkpoints.load(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint

    def load_full_state_dict(self, state_dict: Any, strict: bool = True, prefix: str | None = None) -> None:
        """Load whole weights into the sharded model once set up (`Checkpoints.load_full_state_dict`)."""
        self.checkpoints.load_full_state_dict(state_dict, strict, prefix)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The LightningModule's state dict with fp32 master weights, on every rank (a collective)."""
        return self.checkpoints.full_state_dict()

    # -- teardown and registration --------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        if self.engine is not None:
            # its thread ends and its hooks go; its state stays for trainer.save_checkpoint and leaves with the Trainer
            self.engine.detach()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "zoff", cls, description="ZeRO-3 (FSDP2) with the optimizer and fp32 master offloaded to the CPU",
            offload=True,
        )
        strategy_registry.register(
            "zoff_no_offload", cls, description="ZeRO-3 (FSDP2) with the optimizer on the accelerator",
            offload=False,
        )
