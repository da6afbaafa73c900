"""ZoffStrategy: Lightning glue for ZeRO-3 sharding (FSDP2) with the optimizer on the CPU. No tensor math here.

This file holds the model, the optimizer and the training step; its two bases hold the ranks (`strategy_processes`)
and the checkpoints (`strategy_checkpoint`), and `checks` what it refuses."""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from typing_extensions import override

from lightning_zoff._compat import distributed_is_initialized, set_strategy_precision_plugin, strategy_precision_plugin
from lightning_zoff.checks import (
    ACCUM_DTYPES,
    MOMENT_DTYPES,
    ONE_OPTIMIZER,
    StartMethod,
    check_accum_dtype,
    check_optimizers,
    check_options,
    check_supported,
)
from lightning_zoff.cpus import CpuLayout, torch_threads
from lightning_zoff.node_log import log_for_node
from lightning_zoff.offload import OffloadEngine, StepOutcome, describe_memory
from lightning_zoff.offload.memory_plan import (
    Machine,
    MemoryPlan,
    StateOptions,
    accelerator_holds_all,
    measure_machine,
    plan_memory,
)
from lightning_zoff.offload.placement import Placement, parse_accelerator_state
from lightning_zoff.precision import ZoffPrecision
from lightning_zoff.schedulers import SkipAwareScheduler
from lightning_zoff.sharding import (
    ParamInitFn,
    checkpoint_activations,
    is_sharded,
    plan_units,
    shard_model,
    unit_shapes_before_sharding,
)
from lightning_zoff.strategy_checkpoint import CheckpointingStrategy
from lightning_zoff.strategy_processes import ProcessGroupStrategy
from lightning_zoff.telemetry import StepTimer, step_metrics

log = logging.getLogger("lightning_zoff")


class ZoffStrategy(CheckpointingStrategy, ProcessGroupStrategy):
    """ZeRO-3 training: FSDP2 shards parameters on the accelerator; fp32 master and optimizer state live per rank
    on the host (``offload=True``) or on the accelerator (``offload=False``).

    Args:
        offload: keep the fp32 master weights and optimizer state in host memory and run the update on the CPU.
        accelerator_state: with ``offload``, how much of that state the accelerator keeps instead, updated there:
            ``"auto"`` (default; on a GPU: what the host cannot hold from the start, then, after the first step
            measured its peak memory, as many more units as fit with a margin of max(2 GiB, 5%)), a fraction in
            [0, 1] of the trained parameters (the units the forward needs first), or ``"none"``: all on the host.
            Every unit there takes 28 B/param (fp32 moments) of traffic off the host, zoff's bottleneck.
        wrap_policy: module classes that become FSDP2 units; default: the repeated children of `nn.ModuleList`s.
        activation_checkpointing_policy: module classes whose activations are recomputed in backward instead of
            kept (torch's composable `checkpoint`, applied before sharding; parameter names do not change);
            ``"auto"`` (default): the blocks the wrap policy made units, when the accelerator cannot hold all the
            optimizer state beside the model (the host takes state then, and the host's update, not the accelerator,
            sets the pace: the room activations leave is worth more as state); ``None``: none.
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
        state_dict_type: ``"sharded"``: checkpoints are directories in which every rank writes one file of its own
            rows of the fp32 master weights and optimizer state, resumable at any world size;
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
        accelerator_state: Literal["auto", "none"] | float = "auto",
        wrap_policy: set[type[nn.Module]] | list[type[nn.Module]] | None = None,
        activation_checkpointing_policy: set[type[nn.Module]] | list[type[nn.Module]] | Literal["auto"] | None = "auto",
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
        check_options(start_method=start_method, grad_accum_dtype=grad_accum_dtype,
                      optimizer_state_dtype=optimizer_state_dtype, grad_accum_on=grad_accum_on,
                      state_dict_type=state_dict_type, param_init_fn=param_init_fn, cpu_threads=cpu_threads,
                      offload=offload, pin_memory=pin_memory, weights_to_main_process=weights_to_main_process,
                      retain_gpu_grad_partition_until_step=retain_gpu_grad_partition_until_step)
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.offload = bool(offload)
        self.accelerator_state = parse_accelerator_state(accelerator_state)
        self._placing_by_peak = False  # "auto" on a GPU: after the next step, by its measured peak
        self._moved_back = False
        self._machine: Machine | None = None
        self.wrap_policy = set(wrap_policy) if wrap_policy else None
        self.checkpoint_activations_auto = activation_checkpointing_policy == "auto"
        self.activation_checkpointing_policy: set[type[nn.Module]] = (
            set() if self.checkpoint_activations_auto else set(activation_checkpointing_policy or ()))  # type: ignore[arg-type]
        self.start_method = start_method
        self.weights_to_main_process = weights_to_main_process
        self.pin_memory = bool(pin_memory)
        self.grad_accum_dtype = grad_accum_dtype
        self.optimizer_state_dtype = optimizer_state_dtype
        self.grad_accum_on = grad_accum_on
        self.state_dict_type = state_dict_type
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
        module = self._module
        check_supported(trainer, module)  # the launchers call it too, before any rank starts
        self._check_accum_dtype()
        self.precision_plugin.device_type = self.root_device.type
        self._timer = StepTimer(self.root_device)
        if not is_sharded(module):
            self._close_engine()  # an earlier fit's, of another model
            self._units = plan_units(module, self.wrap_policy)
            self._machine = self._agreed(measure_machine(self.root_device, self.num_processes))
            if trainer.state.fn == TrainerFn.FITTING and self.offload:
                plan = self._check_plan_before_sharding(module, trainer.accumulate_grad_batches)
                if self.checkpoint_activations_auto and not accelerator_holds_all(plan):
                    self._checkpoint_the_blocks(module, plan)
            checkpoint_activations(module, self.activation_checkpointing_policy)
            mesh = init_device_mesh(self.root_device.type, (self.world_size,))
            assert self._cpu_layout is not None  # set in setup_environment
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

    def _agreed(self, machine: Machine) -> Machine:
        """The least memory any rank measured: every rank plans with the same numbers (they read the host at slightly
        different moments), so their plans and their reports agree."""
        if self.world_size == 1 or not distributed_is_initialized():
            return machine
        readings = torch.tensor([machine.host_available, machine.accelerator_capacity or -1], dtype=torch.float64)
        dist.all_reduce(readings, op=dist.ReduceOp.MIN)  # a CPU tensor: gloo, also under "cpu:gloo,cuda:nccl"
        host, accelerator = (int(v) for v in readings.tolist())
        return Machine(host, None if accelerator < 0 else accelerator)

    def _checkpoint_the_blocks(self, module: nn.Module, plan: MemoryPlan) -> None:
        top_level = set(module.children())
        self.activation_checkpointing_policy = {type(unit) for _, unit in self._units if unit not in top_level}
        state = plan.with_placement({s.name: Placement.ACCELERATOR for s in plan.shapes}).accelerator_bytes
        log_for_node(f"activation checkpointing of {sorted(c.__name__ for c in self.activation_checkpointing_policy)}"
                     f" (activation_checkpointing_policy='auto'): the optimizer state ({state / 1e9:.1f} GB) and the"
                     f" model ({plan.model_bytes / 1e9:.1f} GB) do not fit the accelerator together"
                     f" ({(plan.machine.accelerator_capacity or 0) / 1e9:.1f} GB), so activations make room for state",
                     self.global_rank, self.local_rank, self.num_processes)

    def _check_plan_before_sharding(self, module: nn.Module, accumulate_grad_batches: int) -> MemoryPlan:
        """Refuse a model whose optimizer state cannot fit this machine before any of it (or the sharded model) is
        allocated: the engine's plan, assuming the optimizer trains every parameter that requires a gradient."""
        assert self._machine is not None
        param_bytes = self.precision_plugin.param_dtype.itemsize
        shapes, model_bytes = unit_shapes_before_sharding(module, self._units, self.world_size, param_bytes)
        order = {name: i for i, name in enumerate(self._forward_order())}
        options = StateOptions(
            param_bytes=param_bytes, moment_bytes=MOMENT_DTYPES[self.optimizer_state_dtype].itemsize, moments=2,
            sum_bytes=ACCUM_DTYPES[self.grad_accum_dtype].itemsize if accumulate_grad_batches > 1 else 0,
            sum_on_accelerator=self.grad_accum_on == "accelerator",
            retain_device_sum=self.retain_gpu_grad_partition_until_step, overlap=self.overlap, pin=self.pin_memory)
        return plan_memory(sorted(shapes, key=lambda s: order.get(s.name, len(order))), options, self._machine,
                           self.accelerator_state, model_bytes=model_bytes,
                           masters_bytes=model_bytes * 4 // param_bytes)

    def _check_accum_dtype(self) -> None:
        precision = self.precision_plugin
        check_accum_dtype(self.grad_accum_dtype, precision.precision, precision.param_dtype)

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
            self._masters = self.engine.fp32_shards()
            self._close_engine()
        state_device = torch.device("cpu") if self.offload else self.root_device
        threads = self._optimizer_threads()
        with torch_threads(max(torch.get_num_threads(), threads)):  # the host state's first copies
            self.engine = self._build_engine(state_device, threads, trainer.accumulate_grad_batches)
        self.engine.attach()
        self._masters = {}
        self._placing_by_peak = (self.offload and self.accelerator_state == "auto"
                                 and self.root_device.type == "cuda")
        self._log_memory()
        self._log_placement("at setup" + (", more after the first step" if self._placing_by_peak else ""),
                            always=self.offload)
        for config in self.lr_scheduler_configs:
            if config.interval == "step" and not isinstance(config.scheduler, SkipAwareScheduler):
                # steps the wrapped scheduler as Lightning would, minus the skipped steps
                config.scheduler = SkipAwareScheduler(config.scheduler, self._last_step_skipped)  # type: ignore[assignment]

    def _close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _build_engine(self, state_device: torch.device, threads: int, accumulate_grad_batches: int) -> OffloadEngine:
        return OffloadEngine(
            self._units, self._masters, self.optimizers[0],
            world_size=self.world_size, state_device=state_device, pin_memory=self.pin_memory,
            grad_accum_dtype=ACCUM_DTYPES[self.grad_accum_dtype],
            moment_dtype=MOMENT_DTYPES[self.optimizer_state_dtype], accumulate_grad_batches=accumulate_grad_batches,
            accumulate_on_accelerator=self.grad_accum_on == "accelerator",
            retain_device_sum=self.retain_gpu_grad_partition_until_step, threads=threads, overlap=self.overlap,
            machine=self._machine, accelerator_state=self.accelerator_state if self.offload else "none",
            forward_order=self._forward_order(),
        )

    def _forward_order(self) -> list[str]:
        # modules are usually registered in the order the forward runs them; the first forward tells for sure
        position = {name: i for i, (name, _) in enumerate(self._module.named_modules())}
        return sorted((name for name, _ in self._units), key=lambda name: position.get(name, len(position)))

    def _log_step(self, loss_scale: float) -> None:
        # Lightning allows logging from `optimizer_step`; its loggers keep their own cadence
        assert self.engine is not None
        assert self.last_step is not None
        traffic = self.engine.take_traffic()
        # on CUDA the phase times come a step late (see StepTimer); the gate's wait travels with its own window
        times = self._timer.end_window(gate_wait=self.engine.take_gate_wait())
        metrics = step_metrics(times, traffic, self.last_step.grad_norm, self.last_step.skipped, loss_scale)
        self.telemetry = metrics  # the last step's, for callbacks and benchmarks
        self._module.log_dict(metrics, on_step=True, on_epoch=False)

    def _last_step_skipped(self) -> bool:
        return self.last_step is not None and self.last_step.skipped

    def _optimizer_threads(self) -> int:
        if self._cpu_layout is None:  # setup_environment did not run (a strategy driven by hand)
            self._cpu_layout = self._plan_cpu_layout()
        return self._cpu_layout.kernel_threads

    def _place_by_peak(self) -> None:
        """"auto" on a GPU, after a step: more state to the accelerator if the step's peak left room beside the margin,
        some back to the host if it ate into it; after a move, the next step is checked again."""
        assert self.engine is not None
        peak = torch.cuda.max_memory_reserved(self.root_device)
        there, back = self.engine.place_by_peak(peak, more=not self._moved_back)
        self._moved_back = self._moved_back or bool(back)  # never forth again: no oscillation
        self._placing_by_peak = bool(there or back)
        if back:
            torch.cuda.empty_cache()  # the cached blocks of the state moved back would count in the next peak
        torch.cuda.reset_peak_memory_stats(self.root_device)  # the next check reads the next step alone
        moved = f"{len(there)} moved there" if there else f"{len(back)} moved back" if back else "none moved"
        self._log_placement(f"the step peaked at {peak / 1e9:.1f} GB, {moved}", always=True)
        if there or back:
            self.memory_report = self.engine.memory_report()  # the placement now (benchmarks read it after fit)

    def _log_placement(self, why: str, always: bool) -> None:
        assert self.engine is not None
        summary = self.engine.placement_summary()
        (accel, accel_bytes), (host, host_bytes) = summary["accelerator"], summary["host"]
        if accel or always:
            line = (f"optimizer state of {accel} unit(s) ({accel_bytes / 1e9:.1f} GB) on the accelerator, {host} on the"
                    f" host ({host_bytes / 1e9:.1f} GB): accelerator_state={self.accelerator_state!r}, {why}")
            log_for_node(line, self.global_rank, self.local_rank, self.num_processes)

    def _log_memory(self) -> None:
        assert self.engine is not None
        self.memory_report = self.engine.memory_report()
        line = f"{self.engine.threads} CPU threads for the optimizer; memory: {describe_memory(self.memory_report)}"
        log_for_node(line, self.global_rank, self.local_rank, self.num_processes)

    # -- the training step ----------------------------------------------------------------------------------

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.engine is not None
        self.engine.begin_backward(window_ends=self._in_optimizer_step, loss_scale=self.precision_plugin.loss_scale)
        with self._timer.measure("backward"), self._explaining_oom():
            closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
            self.engine.after_backward()
        return closure_loss

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._timer.measure("forward"), self._explaining_oom():
            return super().training_step(*args, **kwargs)

    @contextmanager
    def _explaining_oom(self) -> Generator[None, None, None]:
        # zoff chose to keep optimizer state on the accelerator; a later, larger step must not just die unexplained
        try:
            yield
        except torch.OutOfMemoryError as err:
            accel = self.engine.placement_summary()["accelerator"] if self.engine is not None else (0, 0)
            if not accel[0] or not self.offload:
                raise
            raise torch.OutOfMemoryError(
                f"{err}\nzoff keeps the optimizer state of {accel[0]} unit(s) ({accel[1] / 1e9:.1f} GB) on the"
                f" accelerator (accelerator_state={self.accelerator_state!r}), chosen from the first step's peak"
                " memory; this step needed more. Keep less there: ZoffStrategy(accelerator_state=<a smaller fraction>)"
                " or accelerator_state='none'."
            ) from err

    @override
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
        if self._placing_by_peak:
            self._place_by_peak()
        if self.last_step.skipped:
            log.warning("zoff: non-finite gradient (norm %s) at step %d: step skipped, nothing changed%s",
                        self.last_step.grad_norm, self._module.trainer.global_step,
                        f"; loss scale now {precision.loss_scale:g}" if precision.scaler is not None else "")
        return result

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
