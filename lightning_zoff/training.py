"""One rank's sharded training, for either front door: the model sharded into FSDP2 units with its fp32 masters cut
off, the engine that owns the optimizer state (`offload/engine.py` tells a gradient's whole path), the memory that
plans and reports it, the checkpoints, and the step's timing.

The Trainer's `ZoffStrategy` and Fabric's `ZoffFabricStrategy` each hold one `ShardedTraining` and translate their
framework's calls into these few: `shard`, `build_engine`, `forward`, `backward`, `step`, and the checkpoint methods;
`contract.Core` states them, their order and who owns what. Nothing here imports Lightning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_zoff.checkpoint.checkpoints import Checkpoints
from lightning_zoff.checkpoint.whole_loads import route_whole_loads
from lightning_zoff.config import ZoffConfig
from lightning_zoff.host_watch import HostMemoryLow
from lightning_zoff.launch.cpus import CpuLayout, rank_layout, torch_threads
from lightning_zoff.launch.group import RankGroup
from lightning_zoff.offload import OffloadEngine, StepOutcome
from lightning_zoff.optim.update import host_update_seconds_per_element
from lightning_zoff.placement import PlanDoesNotFit, RankMemory, StepProbe
from lightning_zoff.precision_math import PrecisionMath
from lightning_zoff.sharding import (
    block_classes,
    checkpoint_activations,
    checkpoint_first_blocks,
    is_sharded,
    shard_model,
)
from lightning_zoff.telemetry import StepTimer, step_metrics
from lightning_zoff.units import Unit, forward_order, plan_units

log = logging.getLogger("lightning_zoff")


class ShardedTraining:
    """The sharded model, engine, memory and checkpoints of the rank `group` describes, under `config`. `cpu_layout`:
    the rank's cores as its launch gave them (default: its share of the cores this process may use);
    `root_runs_forward`: the training loop calls the model (Fabric), so the root can be a unit (`units.py`)."""

    def __init__(self, config: ZoffConfig, group: RankGroup, cpu_layout: CpuLayout | None = None, *,
                 root_runs_forward: bool = False) -> None:
        self.config, self.group = config, group
        self.root_runs_forward = root_runs_forward  # the loop calls the model itself (Fabric), not training_step
        self.cpu_layout = cpu_layout or rank_layout(group.local_rank, group.ranks_on_node, config.cpu_threads)
        threads = self.cpu_layout.kernel_threads  # the engine's: the host's update runs on them
        self.memory = RankMemory(config, group,
                                 host_rate=lambda dtype: host_update_seconds_per_element(dtype, threads=threads))
        self.checkpoints = Checkpoints(config, group)
        self.module: nn.Module | None = None
        self.engine: OffloadEngine | None = None
        self.units: list[Unit] = []
        self.masters: dict[int, torch.Tensor] = {}  # fp32 shards by id of the parameter, until an engine takes them
        self.last_step: StepOutcome | None = None
        self._refusal: PlanDoesNotFit | None = None  # the plan's, for a model set up before its optimizer
        self.recomputable: list[nn.Module] = []  # blocks "auto" can switch recompute on for (after an OOM)
        self._peak_stale = False  # a failed try's memory counts in the peak until the rerun's forward
        self.telemetry: dict[str, float] = {}  # the last step's, for callbacks and benchmarks
        self.timer = StepTimer(group.device)

    # -- setup ----------------------------------------------------------------------------------------------

    def shard(self, module: nn.Module, param_dtype: torch.dtype, *, fitting: bool,
              accumulate_grad_batches: int = 1, loader_workers: int = 0, step_probe: StepProbe | None = None) -> None:
        """Shard `module` in place into FSDP2 units of `param_dtype` shards, keeping this rank's fp32 masters, unless it
        came sharded. With offload, the optimizer state is planned first: a model whose state cannot fit is refused
        here, before anything is allocated, when `fitting`; else (a model set up before its optimizer, or for
        evaluation) when an optimizer is set up. A module built on the meta device is materialised a unit at a time.
        `loader_workers`: the rank's DataLoader workers, kept room for on the host; `step_probe`: a batch and the step's
        loss, traced so that the plan counts the step's own memory on a GPU (`placement/step_trace.py`). From then on
        the module's `load_state_dict` of whole tensors loads as `load_full_state_dict` does
        (`checkpoint/whole_loads.py`)."""
        self.module = module
        if is_sharded(module):
            route_whole_loads(module, self)  # this core holds it now
            return
        self.close_engine()  # an earlier fit's, of another model
        self.units = plan_units(module, self.config.wrap_policy, root_runs_forward=self.root_runs_forward)
        self.memory.read_machine(loader_workers)
        policy = self.config.activation_checkpointing_policy
        self.recomputable = []
        if policy == "auto":  # installed on the blocks switched off: the plan or a step out of memory switches it on
            self.recomputable = checkpoint_activations(module, block_classes(self.units), recompute=False)
        elif isinstance(policy, int):
            checkpoint_first_blocks(self.units, policy)
        else:
            checkpoint_activations(module, policy)
        self._refusal = None
        if self.config.offload:
            try:
                self.memory.check_before_sharding(module, self.units, accumulate_grad_batches, param_dtype,
                                                  step_probe, self.recomputable)
            except PlanDoesNotFit as refusal:
                if fitting:
                    raise
                self._refusal = refusal
        mesh = init_device_mesh(self.group.device.type, (self.group.world_size,))
        with torch_threads(len(self.cpu_layout.cores)):  # meta init and master copies: no kernels run yet
            self.masters = shard_model(module, self.units, mesh, param_dtype, self.config.param_init_fn,
                                       self.config.reshard_after_forward)
        module.to(self.group.device)  # buffers and anything FSDP2 did not move
        route_whole_loads(module, self)

    def build_engine(self, optimizer: torch.optim.Optimizer, accumulate_grad_batches: int = 1) -> OffloadEngine:
        """The engine that steps `optimizer` over the sharded module from now on. A new optimizer starts from fresh
        state, as under every Lightning strategy; the fp32 masters of an earlier engine carry over."""
        module = self._module()
        if self._refusal is not None:
            raise self._refusal  # the plan at setup: this model's optimizer state cannot fit
        if self.engine is not None:
            self.masters = self.engine.fp32_shards()
            self.close_engine()
        threads = self.cpu_layout.kernel_threads
        machine = self.memory.machine or self.memory.read_machine()  # read at setup, unless the model came sharded
        with torch_threads(max(torch.get_num_threads(), threads)):  # the host state's first copies
            units = [(unit.name, unit.module) for unit in self.units]
            self.engine = OffloadEngine(units, self.masters, optimizer, self.config,
                                        world_size=self.group.world_size, machine=machine,
                                        accumulate_grad_batches=accumulate_grad_batches, threads=threads,
                                        forward_order=forward_order(module, self.units), step=self.memory.step)
        self.engine.attach()
        self.masters = {}
        self.memory.engine_built(self.engine)
        return self.engine

    # -- the step -------------------------------------------------------------------------------------------

    @contextmanager
    def forward(self) -> Iterator[None]:
        if self._peak_stale and self.group.device.type == "cuda":
            # the failed try's memory is free by now (its traceback was): "auto" places by the rerun's peak alone
            torch.cuda.reset_peak_memory_stats(self.group.device)
        self._peak_stale = False
        with self.timer.measure("forward"), self.memory.explaining_oom(self.engine):
            yield

    @contextmanager
    def backward(self, window_ends: bool, loss_scale: float) -> Iterator[None]:
        """Around one backward; `window_ends`: it is its window's last (the step follows)."""
        engine = self._engine()
        engine.begin_backward(window_ends=window_ends, loss_scale=loss_scale)
        with self.timer.measure("backward"), self.memory.explaining_oom(engine):
            yield
            engine.after_backward()

    def step(self, optimizer: torch.optim.Optimizer, precision: PrecisionMath, step_index: int) -> StepOutcome:
        """The window's step: with overlap this waits for its last gradients to land and decides (the updates run on
        the worker); without, it also updates. The loss scale follows the outcome."""
        engine = self._engine()
        try:
            self.memory.check_host(step_index)  # before the OS's OOM killer would end the run
        except HostMemoryLow:
            engine.abandon_window()  # the state stays the last step's
            raise
        with self.timer.measure("exposed_optimizer"):
            outcome = engine.step(optimizer, precision.take_clip_request(), precision.loss_scale)
        self.last_step = outcome
        if precision.scaler is not None:
            precision.scaler.update(overflow=outcome.skipped)
        placing = time.perf_counter()
        self.memory.after_step(engine)  # "auto" on a GPU: moves by this step's peak, after its host updates
        placement_s = time.perf_counter() - placing
        # on CUDA the phase times come a step late (see StepTimer); the gate's wait travels with its own window
        times = self.timer.end_window(gate_wait=engine.take_gate_wait())
        self.telemetry = step_metrics(times, engine.take_traffic(), outcome.grad_norm, outcome.skipped,
                                      precision.loss_scale) | {"zoff/placement_s": placement_s}
        if outcome.skipped:
            log.warning("zoff: non-finite gradient (norm %s) at step %d: step skipped, nothing changed%s",
                        outcome.grad_norm, step_index,
                        f"; loss scale now {precision.loss_scale:g}" if precision.scaler is not None else "")
        return outcome

    @property
    def memory_report(self) -> dict[str, float]:
        return self.memory.report

    def make_room_after_oom(self) -> bool:
        """After a window's step ran out of accelerator memory before its decision: state moved back to the host, or
        else recompute switched on for the blocks ("auto"), so the same batch can run again
        (`RankMemory.make_room_after_oom`); whether either happened."""
        made = self.memory.make_room_after_oom(self._engine(), self._module(), self.recomputable)
        self._peak_stale = made
        return made

    # -- checkpoints (`Checkpoints`, with this rank's module and engine) --------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.checkpoints.module_state_dict(self._module(), self.engine)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """None before the engine exists (the door's own then)."""
        return self.checkpoints.optimizer_state(self._module(), self.engine, optimizer)

    def save(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Write the door's `checkpoint` dict (its `state_dict` and `optimizer_states` from this object) to `path`."""
        self.checkpoints.save(checkpoint, path, storage_options)

    def remove(self, path: Any) -> None:
        self.checkpoints.remove(path)

    def load(self, path: Any, optimizer: torch.optim.Optimizer | None, weights_only: bool | None = None
             ) -> dict[str, Any]:
        """Restore the weights, and the `optimizer`'s state if given; the rest of the checkpoint, for the door."""
        return self.checkpoints.load(path, self._module(), self.engine, self.masters, optimizer, weights_only)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor] | str | Path, strict: bool = True,
                             prefix: str | None = None) -> None:
        """Whole weights into the sharded model (`Checkpoints.load_full_state_dict`): its state, or before an engine
        exists the fp32 masters it will start from."""
        self.checkpoints.load_full_state_dict(self._module(), self.engine, state_dict, strict, prefix,
                                              masters=self.masters)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict with fp32 master weights, on every rank (a collective)."""
        return self.checkpoints.full_state_dict(self._module(), self._engine())

    # -- lifetime -------------------------------------------------------------------------------------------

    def detach(self) -> None:
        """The end of a run: the engine's thread ends and its hooks go; its state stays for checkpoints."""
        if self.engine is not None:
            self.engine.detach()

    def close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _module(self) -> nn.Module:
        assert self.module is not None, "zoff: no module is set up yet"
        return self.module

    def _engine(self) -> OffloadEngine:
        assert self.engine is not None, "zoff: no optimizer is set up yet"
        return self.engine
