"""What the two front doors (`trainer.ZoffStrategy`, `fabric.ZoffFabricStrategy`) share: the rank's
`ShardedTraining`, held as the `contract.Core` that states what a door may ask of it, the views of it benchmarks and
callbacks read, where the rank stands, how the ranks start and the collectives. Each door mixes this in before its
Lightning base class, whose rank and device attributes it reads and whose methods of the same names it stands in
for.

And what zoff refuses whichever door it came in by, before anything is sharded or allocated: the optimizer (one, of a
class the engine has an update for) and a gradient-sum dtype the model's precision cannot accumulate in. The options
themselves are checked by `ZoffConfig`; the Trainer's door adds its own (`trainer/checks.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from typing_extensions import Self

from lightning_zoff._compat_lightning import set_strategy_launcher
from lightning_zoff.config import ACCUM_DTYPES, ZoffConfig, removed_option
from lightning_zoff.contract import Core
from lightning_zoff.launch import group as rank_group, ranks
from lightning_zoff.launch.cpus import CpuLayout
from lightning_zoff.launch.group import RankGroup
from lightning_zoff.offload import OffloadEngine, StepOutcome
from lightning_zoff.optim.rules import update_rule_for
from lightning_zoff.training import ShardedTraining


class FrontDoor:
    # the door's launchers: Lightning's script re-run (start_method="subprocess"), or its multiprocessing one
    script_launcher: Callable[[ClusterEnvironment, int, int], Any]
    process_launcher: Callable[..., Any]
    config: ZoffConfig
    training: Core | None
    _cpu_layout: CpuLayout | None
    root_runs_forward: bool  # whether the training loop calls the model itself (Fabric) or training_step (Trainer)
    # the Lightning strategy's own
    parallel_devices: list[torch.device] | None
    cluster_environment: ClusterEnvironment | None
    local_rank: int
    global_rank: int
    node_rank: int
    world_size: int
    num_nodes: int

    def __new__(cls, *args: Any, **options: Any) -> Self:
        # an option zoff removed is refused with why it went, not with Python's bare "unexpected keyword argument"
        for name, value in options.items():
            why = removed_option(name)
            if why is not None:
                raise TypeError(f"{cls.__name__}({name}={value!r}): {why}")
        return super().__new__(cls)

    @property
    def engine(self) -> OffloadEngine | None:
        return self.training.engine if self.training is not None else None

    @property
    def last_step(self) -> StepOutcome | None:
        """The last optimizer step's outcome: its gradient norm, clip factor, whether it was skipped."""
        return self.training.last_step if self.training is not None else None

    @property
    def telemetry(self) -> dict[str, float]:
        """The last step's breakdown (forward, backward, exposed optimizer time, bytes moved): what `ZoffStatsMonitor`
        logs."""
        return self.training.telemetry if self.training is not None else {}

    @property
    def memory_report(self) -> dict[str, float]:
        """The engine's memory by kind and side, as last reported (setup, or after "auto" moved state)."""
        return self.training.memory_report if self.training is not None else {}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict with fp32 master weights, on every rank (a collective)."""
        return self._training().full_state_dict()

    def _training(self) -> Core:
        if self.training is None:  # mypy checks here that ShardedTraining meets the contract
            group = RankGroup(self.root_device, self.world_size, self.global_rank, self.local_rank,
                              self.num_processes)
            self.training = ShardedTraining(self.config, group, self._cpu_layout,
                                            root_runs_forward=self.root_runs_forward)
        return self.training

    # -- where the rank stands ------------------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str:
        return self.config.process_group_backend or ranks.default_backend(self.root_device)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self.config.start_method == "subprocess":
            launcher = self.script_launcher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            launcher = self.process_launcher(self, start_method=self.config.start_method)
        set_strategy_launcher(self, launcher)

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]  # the Lightning strategy's, next in the door's bases
        self._start_rank()

    def barrier(self, name: str | None = None) -> None:
        rank_group.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return rank_group.broadcast(obj, src)

    def _set_world_ranks(self) -> None:
        ranks.set_world_ranks(self.cluster_environment, self.node_rank, self.local_rank, self.num_processes,
                              self.num_nodes)

    def _start_rank(self) -> None:
        """Join the process group and take this rank's share of the CPU cores (in `setup_environment`)."""
        self._set_world_ranks()
        assert self.cluster_environment is not None
        self._cpu_layout = ranks.start_rank(
            self.cluster_environment, self.process_group_backend, self.config.timeout, device=self.root_device,
            global_rank=self.global_rank, local_rank=self.local_rank, per_node=self.num_processes,
            cpu_threads=self.config.cpu_threads, offload=self.config.offload)


# -- what either door refuses ---------------------------------------------------------------------------------

ONE_OPTIMIZER = (
    "strategy='zoff' drives exactly one optimizer; {} {}. Put all parameters in one optimizer, using param groups for"
    " different settings."
)


def check_optimizers(optimizers: list[Any], given_by: str = "configure_optimizers returned") -> None:
    """Refuse what the engine cannot step: other than one optimizer, or one of a class zoff has no update for."""
    if len(optimizers) != 1:
        raise ValueError(ONE_OPTIMIZER.format(given_by, len(optimizers)))
    update_rule_for(optimizers[0])


def check_accum_dtype(grad_accum_dtype: str, precision: str, param_dtype: torch.dtype) -> None:
    # The window's gradient sum lives on the host in fp32, or in the model's own 16-bit dtype (half the bytes,
    # rounded at every micro-batch); another dtype would round differently from both.
    valid = sorted({"fp32"} | {name for name, dtype in ACCUM_DTYPES.items() if dtype == param_dtype})
    if grad_accum_dtype not in valid:
        raise ValueError(
            f"grad_accum_dtype={grad_accum_dtype!r} cannot accumulate gradients of a {precision} model; choose one"
            f" of {valid}."
        )
