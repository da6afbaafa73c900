"""ZoffStrategy's processes: each rank's device and CPU cores, how the ranks start, their process group and the
collectives Lightning runs through the strategy."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from lightning_zoff._compat import (
    distributed_is_initialized,
    init_dist_connection,
    set_strategy_launcher,
    sync_ddp_if_available,
)
from lightning_zoff.checks import StartMethod, check_predict_batches
from lightning_zoff.cpus import CpuLayout, bind_rank, plan_layout
from lightning_zoff.launchers import ZoffMultiProcessingLauncher, ZoffSubprocessScriptLauncher
from lightning_zoff.malloc import fix_mmap_threshold
from lightning_zoff.node_log import speak_for_node
from lightning_zoff.rank_errors import report_once_per_node

log = logging.getLogger("lightning_zoff")


class ProcessGroupStrategy(ParallelStrategy):
    """ZoffStrategy's base: one process per device, started by `start_method`, in one process group."""

    start_method: StartMethod
    offload: bool
    cpu_threads: int | None
    num_nodes: int
    _process_group_backend: str | None
    _timeout: timedelta | None
    _cpu_layout: CpuLayout | None

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
        if self._process_group_backend is None:
            self._process_group_backend = "cpu:gloo,cuda:nccl" if self.root_device.type == "cuda" else "gloo"
        return self._process_group_backend

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
        if self.cluster_environment.creates_processes_externally:
            return
        if self.start_method == "subprocess":
            launcher: Any = ZoffSubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            launcher = ZoffMultiProcessingLauncher(self, start_method=self.start_method)
        set_strategy_launcher(self, launcher)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Lightning's own way to tell rank_zero_only the rank (an attribute it reads, untyped)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        init_dist_connection(self.cluster_environment, self.process_group_backend, timeout=self._timeout)
        speak_for_node(self.local_rank)
        report_once_per_node(self.local_rank)  # after init: torch's hook, which it wraps, prefixes the rank
        self._cpu_layout = self._plan_cpu_layout()
        binding = bind_rank(self._cpu_layout, self.root_device.type, self.offload)
        log.debug("zoff rank %d (local %d of %d): %s; %s", self.global_rank, self.local_rank, self.num_processes,
                  self._cpu_layout.describe(), binding)
        if self.root_device.type == "cpu":
            fix_mmap_threshold()  # FSDP2's buffers are host memory here: keep them from piling up in the heap

    def _plan_cpu_layout(self) -> CpuLayout:
        return plan_layout(sorted(os.sched_getaffinity(0)), self.local_rank, self.num_processes, self.cpu_threads)

    # -- data and collectives -------------------------------------------------------------------------------

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        check_predict_batches(dataloader, self.world_size)
        return dataloader

    @override
    def barrier(self, name: str | None = None) -> None:
        if distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=dist.group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
