"""A rank's process: its process group, its CPU cores, how the ranks start, and the reduction Lightning runs through
the strategy. Functions of a strategy's state; both front doors call them from their overrides."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lightning_zoff._compat import expandable_cuda_segments
from lightning_zoff._compat_lightning import init_dist_connection, sync_ddp_if_available
from lightning_zoff.launch.cpus import CpuLayout, bind_rank, rank_layout
from lightning_zoff.launch.malloc import fix_mmap_threshold
from lightning_zoff.launch.node_log import speak_for_node
from lightning_zoff.launch.rank_errors import report_once_per_node

log = logging.getLogger("lightning_zoff")


def default_backend(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"  # host tensors need gloo


def set_world_ranks(environment: ClusterEnvironment | None, node_rank: int, local_rank: int, per_node: int,
                    num_nodes: int) -> int:
    """Tell the cluster environment and Lightning's rank_zero_only this rank's place; its global rank."""
    global_rank = node_rank * per_node + local_rank
    if environment is not None:
        environment.set_global_rank(global_rank)
        environment.set_world_size(num_nodes * per_node)
    # Lightning's own way to tell rank_zero_only the rank (an attribute it reads, untyped)
    rank_zero_only.rank = utils_rank_zero_only.rank = global_rank  # type: ignore[attr-defined]
    return global_rank


def start_rank(environment: ClusterEnvironment, backend: str, timeout: timedelta | None, *, device: torch.device,
               global_rank: int, local_rank: int, per_node: int, cpu_threads: int | None, offload: bool
               ) -> CpuLayout:
    """Join the process group, set up the node's messages, and give the rank its share of the CPU cores; its CPU
    layout."""
    reset_seed()
    nccl = device.type == "cuda" and "nccl" in backend
    if nccl:  # NCCL reads it when its communicator is made: every peer's buffers then, none later
        os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
    init_dist_connection(environment, backend, timeout=timeout)
    speak_for_node(local_rank)
    report_once_per_node(local_rank)  # after init: torch's hook, which it wraps, prefixes the rank
    layout = rank_layout(local_rank, per_node, cpu_threads)
    binding = bind_rank(layout, device.type, offload)
    log.debug("zoff rank %d (local %d of %d): %s; %s", global_rank, local_rank, per_node, layout.describe(), binding)
    if device.type == "cpu":
        fix_mmap_threshold()  # FSDP2's buffers are host memory here: keep them from piling up in the heap
    elif device.type == "cuda":
        expandable_cuda_segments()  # "auto" places state by the memory the allocator reserved: no fragments
        if nccl:
            make_nccl_communicator(device)
    return layout


def make_nccl_communicator(device: torch.device) -> None:
    """NCCL's communicator and its buffers, made now rather than at the first collective on a CUDA tensor: the plan
    reads the GPU's free memory next and lets the allocator fill it, and NCCL allocating there later, outside the
    allocator, fails as "unhandled cuda error" (LitGPT's full.py on Llama-3-8B, 1x H100, 2026-12-07: the suspected
    cause, unconfirmed)."""
    dist.all_reduce(torch.zeros(1, device=device))
    torch.cuda.synchronize(device)


def reduce(tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
    if isinstance(tensor, torch.Tensor):
        return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
    return tensor
