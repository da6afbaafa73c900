"""The machine a rank plans for: the host memory it may use and what its accelerator can hold, read once at setup,
before anything is allocated, and agreed among the ranks (every rank plans with the same numbers)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from lightning_zoff.launch.group import RankGroup, group_is_up

GB = 1e9
GiB = 2**30
# of the host memory available at setup, left to the rest of the process (CUDA, Python, data, checkpoints) and the OS:
# the 13B GPT on a 134 GB host peaked 2.1 GB above its plan with 10% (121 GB with the plan at 119)
HOST_RESERVE = 0.17
# kept for each DataLoader worker of a rank: a worker is a fork of the rank that inherits none of zoff's buffers
# (`host_buffers.py`), so it owns only the pages of the rank's Python heap it writes (reference counts, the collector)
# and its batches: 11 MB (USS) after 200 batches on CPU; Llama-3-8B on 1x H100 with 4 workers peaked at 104.1 GB of the
# process tree's PSS, 104.7 without (2026-12-06). A GiB each covers a large heap and large batches.
LOADER_WORKER_BYTES = GiB


def size(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB" if abs(nbytes) >= 0.1 * GB else f"{nbytes / 1e6:.1f} MB"


def margin_bytes(total: int) -> int:
    """Accelerator memory "auto" leaves free: room for a longer batch and the allocator's fragmentation."""
    return max(2 * GiB, int(0.05 * total))


def slack_bytes(total: int) -> int:
    """Accelerator memory a plan that counts the step itself leaves free: the allocator's fragmentation and the CUDA
    libraries' workspaces (cuBLAS takes 32 MiB per stream that multiplies), which no trace sees. Qwen3-14B b1 on 1x
    H100 peaked 6 GB under the 84.5 its allocator could hold, with 11 allocator retries (2026-12-06)."""
    return max(GiB, int(0.02 * total))


@dataclass(frozen=True)
class Machine:
    """What this rank may use, read once at setup before anything is allocated."""

    host_available: int  # this rank's share of the host memory available then
    accelerator_capacity: int | None  # what this rank's allocator may hold on its CUDA device; None: no GPU
    loader_workers: int = 0  # this rank's DataLoader worker processes

    @property
    def host_kept(self) -> int:
        """Host memory left to the rest of the process tree: this process beside zoff's state, the OS, and the rank's
        DataLoader workers."""
        return max(GiB // 4, int(HOST_RESERVE * self.host_available)) + self.loader_workers * LOADER_WORKER_BYTES

    @property
    def host_capacity(self) -> int:
        """What zoff may hold on the host: the available memory less what is kept for the rest."""
        return max(0, self.host_available - self.host_kept)

    @property
    def accelerator_margin(self) -> int:
        return 0 if self.accelerator_capacity is None else margin_bytes(self.accelerator_capacity)

    @property
    def accelerator_slack(self) -> int:
        return 0 if self.accelerator_capacity is None else slack_bytes(self.accelerator_capacity)


def accelerator_capacity(device: torch.device) -> int:
    """What this process's CUDA allocator can hold on `device`: its free memory and what it has reserved, capped by a
    per-process memory fraction. Other processes' contexts and allocations on the device are not in it."""
    if device.index is None:  # torch's per-process fraction wants an index
        device = torch.device(device.type, torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    cap = int(total * (get_fraction(device) if get_fraction is not None else 1.0))
    return min(cap, free + torch.cuda.memory_reserved(device))


def measure_machine(group: RankGroup, loader_workers: int = 0) -> Machine:
    """The host's available memory (ZOFF_HOST_MEMORY_BYTES overrides it: tests, shared hosts) split among the node's
    ranks, and what this process's CUDA allocator can hold (a per-process memory fraction counts); `loader_workers`:
    the rank's DataLoader workers, kept room for. The least any rank of `group` measured: every rank plans with the
    same numbers (they read the host at slightly different moments), so their plans and their reports agree."""
    device = group.device
    available = int(os.environ.get("ZOFF_HOST_MEMORY_BYTES", 0)) or psutil.virtual_memory().available
    accelerator = accelerator_capacity(device) if device.type == "cuda" else None
    machine = Machine(available // group.ranks_on_node, accelerator, loader_workers)
    if group.world_size > 1 and group_is_up():
        readings = torch.tensor([machine.host_available, machine.accelerator_capacity or -1], dtype=torch.float64)
        dist.all_reduce(readings, op=dist.ReduceOp.MIN)  # a CPU tensor: gloo, also under "cpu:gloo,cuda:nccl"
        host, capacity = (int(v) for v in readings.tolist())
        machine = Machine(host, None if capacity < 0 else capacity, loader_workers)
    return machine
