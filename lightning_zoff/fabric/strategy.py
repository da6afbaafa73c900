"""ZoffFabricStrategy: Fabric's front door to ZeRO-3 sharding (FSDP2) with the optimizer on the CPU; Fabric glue, no
tensor math. The same `ZoffConfig` options and the same `ShardedTraining` as the Trainer's `ZoffStrategy`:

    fabric = Fabric(strategy="zoff", devices=2, precision="bf16-mixed")
    fabric.launch()
    with fabric.init_module(empty_init=True):     # on the meta device: each rank materialises its own units
        model = GPT(config)
    model = fabric.setup(model)                                                  # or both together:
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))  # fabric.setup(model, optimizer)
    for i, batch in enumerate(loader):
        with fabric.no_backward_sync(model, enabled=(i + 1) % accumulate != 0):  # the window goes on
            fabric.backward(model(batch) / accumulate)                          # gradients land on the host
        if (i + 1) % accumulate == 0:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()                                                    # the engine's update
            optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from typing_extensions import override

from lightning_zoff._compat_lightning import (
    FabricSubprocessScriptLauncher,
    fabric_strategy_precision,
    set_fabric_strategy_precision,
)
from lightning_zoff.config import ZoffConfig, with_options_doc
from lightning_zoff.contract import Core
from lightning_zoff.doors import FrontDoor, check_accum_dtype, check_optimizers
from lightning_zoff.fabric import checkpoints
from lightning_zoff.fabric.launcher import ZoffFabricMultiProcessingLauncher
from lightning_zoff.fabric.precision import ZoffFabricPrecision
from lightning_zoff.launch import ranks
from lightning_zoff.launch.cpus import CpuLayout
from lightning_zoff.sharding import param_names


@with_options_doc
class ZoffFabricStrategy(FrontDoor, ParallelStrategy):
    """ZeRO-3 training for Fabric with the optimizer on the CPU: `Fabric(strategy=ZoffFabricStrategy(**options))`.

    FSDP2 shards parameters on the accelerator; fp32 master and optimizer state live per rank on the host
    (``offload=True``), updated by the CPU, or on the accelerator. Each keyword option is a field of `ZoffConfig`
    (`lightning_zoff.config`), as for `ZoffStrategy`; `self.config` holds them. The options' meanings below are the
    fields' docs."""

    script_launcher = FabricSubprocessScriptLauncher
    process_launcher = ZoffFabricMultiProcessingLauncher
    root_runs_forward = True  # fabric's loop calls the model

    def __init__(self, accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision: Precision | None = None,
                 **options: Any) -> None:
        self.config = ZoffConfig(**options)
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision)
        self._num_nodes = 1
        self._window = _WindowControl()
        self._backward_sync_control = self._window
        self.training: Core | None = None  # once the ranks' places are known
        self._cpu_layout: CpuLayout | None = None
        self._steps = 0
        self._names: dict[int, str] = {}  # the set-up module's parameters' names by id, from before it was sharded

    # -- precision: whatever the `precision=` flag built becomes a ZoffFabricPrecision ---------------------

    @property
    @override
    def precision(self) -> ZoffFabricPrecision:
        plugin = fabric_strategy_precision(self)
        if plugin is None:
            plugin = ZoffFabricPrecision("32-true")
            set_fabric_strategy_precision(self, plugin)
        return plugin

    @precision.setter
    @override
    def precision(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZoffFabricPrecision):
            plugin = ZoffFabricPrecision(getattr(plugin, "precision", "32-true"))
        set_fabric_strategy_precision(self, plugin)

    # -- processes ------------------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return self._num_nodes  # where Fabric's connector writes it

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @override
    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return ranks.reduce(tensor, group, reduce_op)

    # -- model and optimizer --------------------------------------------------------------------------------

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        # empty_init: built on the meta device; setup materialises and initialises one unit at a time while
        # sharding, so no rank ever holds the whole model
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        pass  # moved once sharded: a model on the meta device has nothing to move yet

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                                    scheduler: Any = None) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        """Shard `module` and build the engine that steps the one optimizer, whose param groups then hold the sharded
        parameters in place of those it was made with. The same as `setup_module`, then `setup_optimizer`, but a
        model whose optimizer state cannot fit is refused before it is sharded."""
        check_optimizers(optimizers, "fabric.setup got")
        self._setup_module(module, fitting=True)
        return module, [self.setup_optimizer(optimizers[0])], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard `module`: for evaluation or sampling, or before its optimizer is made over the sharded parameters and
        set up with `fabric.setup_optimizers` (LitGPT's scripts' order)."""
        self._setup_module(module, fitting=False)
        return module

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Build the engine that steps `optimizer` over the set-up model. An optimizer made before the model was set up
        is pointed at the sharded parameters (by name); one made after holds them already. A later optimizer replaces
        the earlier one, with fresh state."""
        check_optimizers([optimizer], "fabric.setup_optimizers got")
        training = self._training()
        if training.module is None:
            raise ValueError("strategy='zoff' shards the model before it builds the optimizer's state: call"
                             " `model = fabric.setup(model)` first, then make the optimizer over `model.parameters()`"
                             " and call `fabric.setup_optimizers(optimizer)`.")
        precision = self.precision
        check_accum_dtype(self.config.grad_accum_dtype, precision.precision, precision.param_dtype)
        sharded = dict(training.module.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[self._names[id(p)]] if id(p) in self._names else p for p in group["params"]]
        training.build_engine(optimizer)
        self.barrier()
        return optimizer

    def _setup_module(self, module: nn.Module, fitting: bool) -> None:
        """Shard `module`; `fitting`: an optimizer comes with it, so a model whose state cannot fit is refused before
        it is sharded (else when the optimizer is set up: evaluation needs no optimizer state)."""
        self._names = {pid: all_names[0] for pid, all_names in param_names(module).items()}  # before sharding
        training = self._training()
        self.precision.device_type = self.root_device.type
        self.precision.around_forward = training.forward
        # Fabric's dataloaders may be set up after the model: only the option tells their workers
        training.shard(module, self.precision.param_dtype, fitting=fitting,
                       loader_workers=self.config.loader_workers or 0)
        self.barrier()

    # -- the training step ----------------------------------------------------------------------------------

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        precision = self.precision
        window_ends = not self._window.accumulating
        with self._training().backward(window_ends, precision.loss_scale):
            precision.scale_loss(tensor).backward(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        # The engine took every gradient in backward and runs the update; torch's own step would see no gradient.
        if kwargs:
            raise ValueError(f"strategy='zoff' steps the optimizer itself and takes no {sorted(kwargs)}.")
        engine = self._training().engine
        if engine is not None and optimizer is not engine.optimizer:
            raise ValueError("strategy='zoff' steps the optimizer set up last (fabric.setup_optimizers replaced this"
                             " one); step that one.")
        outcome = self._training().step(optimizer, self.precision, self._steps)
        self._steps += 1
        return outcome

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Record the request: the next `optimizer.step()` clips with the norm of the whole (global, accumulated)
        gradient, which only exists once the window's last gradients have landed. So this returns NaN; the norm
        before clipping is `strategy.last_step.grad_norm` after the step."""
        if norm_type != 2.0:
            raise ValueError(f"strategy='zoff' clips by the 2-norm only, not norm_type={norm_type}.")
        self.precision.request_clip(max_norm)
        return torch.tensor(float("nan"))

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: torch.optim.Optimizer, clip_val: float | int) -> None:
        raise ValueError("strategy='zoff' clips gradients by norm only: fabric.clip_gradients(model, optimizer,"
                         " max_norm=...).")

    # -- checkpoints (`fabric/checkpoints.py`) ---------------------------------------------------------------

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Any] | None = None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError("strategy='zoff' writes checkpoints itself and takes no storage_options or filter.")
        checkpoints.save(self._training(), self.precision, path, state)

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        if isinstance(state, torch.optim.Optimizer):
            raise ValueError("strategy='zoff' keeps the optimizer's state in its own checkpoints:"
                             " fabric.load(path, {'model': model, 'optimizer': optimizer}) restores it; fabric.load_raw"
                             " loads a model's weights only.")
        if isinstance(state, nn.Module):  # fabric.load_raw(path, model): whole weights, a pretrained model's
            checkpoints.load_raw(self._training(), path, strict)
            return {}
        if not isinstance(state, dict) or not any(isinstance(v, nn.Module) for v in state.values()):
            raise ValueError("strategy='zoff' loads into the set-up model: fabric.load(path, {'model': model,"
                             " 'optimizer': optimizer, ...}).")
        return checkpoints.load(self._training(), self.precision, path, state, strict, weights_only)

    # -- teardown --------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        if self.training is not None:
            self.training.detach()  # its thread ends and its hooks go; its state stays for fabric.save
        super().teardown()


class _WindowControl(_BackwardSyncControl):
    """`fabric.no_backward_sync(model, enabled=True)` around a micro-batch: its window goes on after this backward
    (the gradient is summed on the host; FSDP2 still reduce-scatters it, zoff's engine needs every rank's shard)."""

    def __init__(self) -> None:
        self.accumulating = False

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self._window_goes_on(enabled)

    @contextmanager
    def _window_goes_on(self, enabled: bool) -> Generator[None, None, None]:
        before, self.accumulating = self.accumulating, enabled
        try:
            yield
        finally:
            self.accumulating = before
