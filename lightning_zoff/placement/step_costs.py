"""What one more recomputed block costs a step against what keeping its activations costs, for "auto" (issue 53): a
recomputed block runs its forward again in every micro-batch's backward; a kept one holds accelerator memory that
would otherwise hold optimizer state, whose update then runs on the host. With many micro-batches a step (MegaTrain's
Qwen2.5-7B runs 18) the recompute is the dearer; with one, the host's update.

Both rates are measured at setup, in tens of milliseconds: the accelerator's on a bf16 matrix product, and the host's
fused update over more elements than a cache holds (timed by the optimizer package, which placement does not load).
The recompute side holds on the GPU (1x H100, 2026-12-07: 75-83 ms a block estimated, about 90 measured). The
displaced side counts a unit's host update as wholly exposed, and the measured curve at MegaTrain's configuration
does not contradict the choice it makes: on one lent H100, "auto" recomputed 13 of 28 blocks and ran 16.3 s a step
(2 profiled steps), 15, 18 and 22 blocks pinned ran 16.8, 16.8 and 17.4 (bench/README.md, "The recompute curve"). On
another, whose host update ran at 68-77 GB/s where this one's ran at 115-270, the same 13 blocks ran 17.4-17.7 s: what
a unit on the host costs is the host's, and the trade reads the host's rate at setup.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_zoff.placement.plan import StepMemory

PRODUCT = 4096  # the accelerator's product measured: 4096 x 4096 by 4096 x 4096 in bf16
REPEATS = 5


@dataclass(frozen=True)
class Rates:
    accelerator_flops_per_s: float  # a bf16 matrix product's
    host_s_per_element: float  # the host's fused optimizer update, per element of state


@dataclass(frozen=True)
class BlockTrade:
    """Seconds a step, for one block."""

    recompute_s: float  # recomputed: its forward once more in each micro-batch's backward
    displaced_s: float  # kept: the host's update of the optimizer state its activations take the place of

    @property
    def keep_activations(self) -> bool:
        return self.recompute_s > self.displaced_s

    def describe(self, micro_batches: int) -> str:
        batches = f"{micro_batches} micro-batch{'' if micro_batches == 1 else 'es'}"
        return (f"a block recomputed costs {self.recompute_s * 1e3:.1f} ms a step ({batches}), the optimizer state its"
                f" activations displace {self.displaced_s * 1e3:.1f} ms of host update")


def block_trade(kept: StepMemory, recomputed: StepMemory, blocks: int, micro_batches: int,
                accelerator_bytes_per_element: int, rates: Rates) -> BlockTrade:
    """The trade per block from the step traced with none and with all of `blocks` recomputed (their FLOPs and bytes
    differ by the blocks' forwards and activations), at `micro_batches` a step."""
    recompute_flops = max(0, recomputed.flops - kept.flops) / blocks
    displaced_elements = max(0, kept.activations - recomputed.activations) / blocks / accelerator_bytes_per_element
    return BlockTrade(recompute_s=recompute_flops * micro_batches / rates.accelerator_flops_per_s,
                      displaced_s=displaced_elements * rates.host_s_per_element)


HostRate = Callable[[torch.dtype], float]  # the host's fused update with moments of a dtype: seconds per element


def measure_rates(device: torch.device, moment_dtype: torch.dtype, host_rate: HostRate) -> Rates:
    """Both rates on this machine, now (tens of milliseconds; the memory is freed after): the host's from
    `host_rate` (the optimizer package times its own kernel: `optim/update.host_update_seconds_per_element`)."""
    return Rates(_product_flops_per_s(device), host_rate(moment_dtype))


def _product_flops_per_s(device: torch.device) -> float:
    on_cuda = device.type == "cuda"
    n = PRODUCT if on_cuda else PRODUCT // 8  # a CPU stands in for an accelerator only in tests
    dtype = torch.bfloat16 if on_cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm: cuBLAS's choice of kernel
    seconds = _timed(lambda: a @ b, device)
    if on_cuda:
        del a, b
        torch.cuda.empty_cache()  # nothing of it stays beside the plan
    return 2 * n**3 / seconds


def _timed(work: Callable[[], object], device: torch.device) -> float:
    """The fastest of `REPEATS` runs of `work`, in seconds."""
    best = float("inf")
    for _ in range(REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best
