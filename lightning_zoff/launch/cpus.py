"""Which host cores each rank of a node uses, so ranks' kernel threads do not oversubscribe the machine."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuLayout:
    cores: tuple[int, ...]  # this rank's cores
    kernel_threads: int  # the optimizer kernels' OpenMP threads
    torch_threads: int  # torch's intra-op threads in this process

    def describe(self) -> str:
        return (f"cores {_ranges(self.cores)} ({len(self.cores)}), {self.kernel_threads} optimizer threads,"
                f" {self.torch_threads} torch threads")


def core_share(cores: Sequence[int], local_rank: int, local_ranks: int) -> tuple[int, ...]:
    """This rank's contiguous slice of the node's cores: an equal share each (at least one core; with more ranks
    than cores, ranks share cores round-robin)."""
    cores = sorted(cores)
    per = max(1, len(cores) // max(1, local_ranks))
    start = (local_rank * per) % len(cores)
    return tuple(cores[start : start + per])


def plan_layout(cores: Sequence[int], local_rank: int, local_ranks: int, kernel_threads: int | None) -> CpuLayout:
    """`kernel_threads` None: the whole share. Keeping a core for the training thread was measured slower on the H200
    machine (1.34B GPT, accumulate 1: 0.575 s/step with 15 of 16 cores, 0.465 s with all 16): the update is bound by
    memory bandwidth, and the training thread mostly waits on the GPU."""
    share = core_share(cores, local_rank, local_ranks)
    kernel_threads = kernel_threads or len(share)
    return CpuLayout(share, kernel_threads, max(1, len(share) - kernel_threads))


def rank_layout(local_rank: int, per_node: int, cpu_threads: int | None) -> CpuLayout:
    """This rank's layout among the cores this process may use."""
    return plan_layout(sorted(os.sched_getaffinity(0)), local_rank, per_node, cpu_threads)


def apply_layout(layout: CpuLayout) -> None:
    """Confine this process (and the threads it starts from now on) to its cores and size torch's pool."""
    import torch

    os.sched_setaffinity(0, layout.cores)
    torch.set_num_threads(layout.torch_threads)


def bind_rank(layout: CpuLayout, device_type: str, offload: bool) -> str:
    """Apply `layout` where it helps, and say what was done (for the log)."""
    if device_type == "cuda" and offload:
        # each rank of the node on its own cores, torch's pool shrunk to what the kernels leave (on CPU
        # machines torch's threads do the training itself, so they keep the process's cores)
        apply_layout(layout)
        return "bound to these cores"
    if device_type == "cuda":
        return "not bound to these cores: the optimizer runs on the accelerator (offload=False)"
    import torch

    return (f"not bound to these cores: the model trains on the CPU, so zoff leaves the process's cores and torch's"
            f" threads ({torch.get_num_threads()} now) as they are; this share sizes only the optimizer's threads")


def _ranges(cores: Sequence[int]) -> str:
    parts, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            parts.append(f"{start}" if start == core else f"{start}-{core}")
            start = None
    return ",".join(parts)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's pool at `n` threads for a while (building the host state: large copies, no kernels running)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
