"""ZoffStrategy: the Trainer's front door to ZeRO-3 sharding (FSDP2) with the optimizer on the CPU; Lightning glue,
no tensor math. Its options are a `ZoffConfig`; the sharded model, its engine, memory and checkpoints are one
`ShardedTraining` (the object Fabric's door drives too); it runs each rank through `launch.ranks` and refuses what
either door refuses (`doors`) and what only the Trainer's does (`trainer/checks`)."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from lightning_zoff._compat_lightning import (
    set_strategy_launcher,
    set_strategy_precision_plugin,
    strategy_precision_plugin,
)
from lightning_zoff.config import ParamInitFn, StartMethod, ZoffConfig, with_options_doc
from lightning_zoff.contract import Core
from lightning_zoff.doors import ONE_OPTIMIZER, FrontDoor, check_accum_dtype, check_optimizers
from lightning_zoff.launch import ranks
from lightning_zoff.launch.cpus import CpuLayout
from lightning_zoff.trainer.checks import check_predict_batches, check_supported
from lightning_zoff.trainer.launchers import ZoffMultiProcessingLauncher, ZoffSubprocessScriptLauncher
from lightning_zoff.trainer.loaders import check_counted, loader_workers
from lightning_zoff.trainer.loops import continue_step_count, fabric_step_count
from lightning_zoff.trainer.precision import ZoffPrecision
from lightning_zoff.trainer.schedulers import SkipAwareScheduler
from lightning_zoff.trainer.step_probe import step_probe


@with_options_doc
class ZoffStrategy(FrontDoor, ParallelStrategy):
    """ZeRO-3 training for the Trainer with the optimizer on the CPU: `Trainer(strategy=ZoffStrategy(**options))`.

    FSDP2 shards parameters on the accelerator; fp32 master and optimizer state live per rank on the host
    (``offload=True``), updated by the CPU, or on the accelerator. Each keyword option is a field of `ZoffConfig`
    (`lightning_zoff.config`), which documents and checks it; `self.config` holds them. The options' meanings below
    are the fields' docs."""

    strategy_name = "zoff"
    script_launcher = ZoffSubprocessScriptLauncher
    process_launcher = ZoffMultiProcessingLauncher
    root_runs_forward = False  # Lightning calls training_step, which need not call the LightningModule's forward

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
        accelerator_update_share: Literal["auto", "none"] | float = "auto",
        wrap_policy: set[type[nn.Module]] | list[type[nn.Module]] | None = None,
        activation_checkpointing_policy: set[type[nn.Module]] | list[type[nn.Module]] | Literal["auto"] | int | None
        = "auto",
        reshard_after_forward: bool = True,
        staging_ring_units: int | Literal["auto"] = "auto",
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
        loader_workers: int | None = None,
        host_memory_floor: float | None = None,
        param_init_fn: ParamInitFn | None = None,
    ) -> None:
        options = {name: value for name, value in locals().items() if name in ZoffConfig.__dataclass_fields__}
        self.config = ZoffConfig(**options)
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.num_nodes = 1
        self.training: Core | None = None  # once the ranks' places are known (setup)
        self._in_optimizer_step = False
        self._cpu_layout: CpuLayout | None = None
        self._loader_workers: int | None = None  # what the host plan counted, once set up
        self.requested_weights_only: bool | None = None  # fit/test(weights_only=...), as the launcher saw it

    @property
    def module(self) -> pl.LightningModule:
        """The LightningModule: Lightning connects it before the strategy needs it."""
        module = self.lightning_module
        assert module is not None, "zoff: the strategy has no LightningModule yet"
        return module

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

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self.launcher is None:
            # ranks started outside (torchrun, SLURM, or this process is rank 0 of an earlier fit's launch): the
            # script launcher starts none then, and checks in every rank what can be refused before setup
            assert self.cluster_environment is not None
            launcher = self.script_launcher(self.cluster_environment, self.num_processes, self.num_nodes)
            set_strategy_launcher(self, launcher)

    @property
    def is_distributed(self) -> bool:
        # Lightning adds the DistributedSampler and syncs `self.log(sync_dist=True)` only when this is True.
        return True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        check_predict_batches(dataloader, self.world_size)
        if self.module.trainer.training:
            check_counted(dataloader, self._loader_workers)
        return dataloader

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
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync is not None:
            # sync_batchnorm=True: the module's BatchNorm layers become SyncBatchNorm in place, before sharding, as
            # Lightning's DDP and FSDP strategies do. They stay so after fit (the model stays sharded); their state
            # dict's keys are BatchNorm's, so checkpoints load into the plain model.
            self._layer_sync.apply(module)
        self._loader_workers = loader_workers(trainer, self.config.loader_workers)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._training().shard(module, precision.param_dtype, fitting=fitting,
                               accumulate_grad_batches=trainer.accumulate_grad_batches,
                               loader_workers=self._loader_workers,
                               step_probe=step_probe(trainer, module, precision.forward_context) if fitting else None)
        self.barrier()
        if fitting:
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
                raise ValueError(ONE_OPTIMIZER.format("configure_optimizers returned", "several")) from err
            raise
        check_optimizers(self.optimizers)
        # a resume with ckpt_path restores the optimizer's state later, in load_checkpoint
        self._training().build_engine(self.optimizers[0], trainer.accumulate_grad_batches)
        for config in self.lr_scheduler_configs:
            if config.interval == "step" and not isinstance(config.scheduler, SkipAwareScheduler):
                # steps the wrapped scheduler as Lightning would, minus the skipped steps
                config.scheduler = SkipAwareScheduler(config.scheduler, self._last_step_skipped)  # type: ignore[assignment]

    def _last_step_skipped(self) -> bool:
        return self.last_step is not None and self.last_step.skipped

    # -- the training step ----------------------------------------------------------------------------------

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self._training().backward(self._in_optimizer_step, self.precision_plugin.loss_scale):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._training().forward():
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
        training = self._training()
        training.step(optimizer, self.precision_plugin, self.module.trainer.global_step)
        return result

    def _run_window_end(self, optimizer: Any, closure: Any, model: Any, **kwargs: Any) -> Any:
        """The window's last forward and backward (Lightning's closure). On one rank, a window of one micro-batch that
        runs the accelerator out of memory runs again once state moved back to the host, or else recompute of the
        blocks' activations ("auto"), makes room: nothing was applied yet. (Ranks that did not fail would wait in
        collectives the failed one left: they stop.) A try that fails with nothing left to change raises."""
        while True:
            try:
                return super().optimizer_step(optimizer, closure, model, **kwargs)
            except torch.OutOfMemoryError:
                one_window = self.world_size == 1 and self.module.trainer.accumulate_grad_batches == 1
                if not one_window or not self._training().make_room_after_oom():
                    raise

    # -- checkpoints (`ShardedTraining`'s) -----------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._training().state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        state = self._training().optimizer_state(optimizer) if self.engine is not None else None
        return super().optimizer_state(optimizer) if state is None else state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self._training().save(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self._training().remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Restores the weights (and, when fitting, the optimizer state) right here; Lightning restores the rest
        # (loops, LR schedulers, callbacks, loss scaler) from the dict returned.
        fitting = self.module.trainer.state.fn == TrainerFn.FITTING and self.engine is not None
        if weights_only is None:  # Lightning drops it on the way here for a strategy that restores after setup
            weights_only = self.requested_weights_only
        checkpoint = self._training().load(checkpoint_path, self.optimizers[0] if fitting else None, weights_only)
        step = fabric_step_count(checkpoint, checkpoint_path) if fitting else None
        if step is not None:  # written by fabric.save: no loops for Lightning to restore
            continue_step_count(self.module.trainer.fit_loop, step)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint

    def load_full_state_dict(self, state_dict: Any, strict: bool = True, prefix: str | None = None) -> None:
        """Load whole weights into the sharded model once set up (`Checkpoints.load_full_state_dict`)."""
        self._training().load_full_state_dict(state_dict, strict, prefix)

    # -- teardown --------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        if self.training is not None:
            # its thread ends and its hooks go; its state stays for trainer.save_checkpoint and leaves with the Trainer
            self.training.detach()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
