"""bench.py's run "torchao_cpu_offload": torchao's `CPUOffloadOptimizer` in its documented use (torchao/optim's
README), `CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True)`, on one GPU in a plain PyTorch loop: the
model on the GPU (fp32 weights, bf16 autocast), each parameter's fp32 copy and AdamW state on the host, its gradient
copied there on a side stream as backward produces it and its update run by the CPU's fused AdamW in `step()`.

Not clipped, and never under the Trainer: the optimizer never holds all the gradients at once (each lands on its own
event), so there is no global norm to clip by; and Lightning's strategies read `optimizer.state`, which
CPUOffloadOptimizer (an Optimizer that skips `Optimizer.__init__`) lacks. A call that clips the other runs records
this one as inexact, and `--clip NORM` given on the command line is refused for it. It needs torchao (not a
dependency: scripts/device/torchao_wheels.sh for the GPU machine) and a CUDA or XPU device (its constructor asserts
so): without either the run is an "unsupported" entry with the reason.
"""

from __future__ import annotations

import functools
import importlib.util
import statistics
import time
from typing import Any

import psutil

from zoffbench.harness import StepMeasurement

NAME = "torchao_cpu_offload"
PIN = "torchao==0.18.0"  # needs torch >= 2.11 (its release notes); the GPU machine has 2.11, this box 2.13
UNCLIPPED = "not clipped (CPUOffloadOptimizer's documented use: it never holds every gradient at once)"


def refusal(clip_asked: bool, gpus: int) -> str | None:
    """Why the torchao run cannot run here, or None: torchao missing, no GPU, or clipping asked for."""
    if importlib.util.find_spec("torchao") is None:
        return f"torchao is not installed (pip install {PIN}; on the GPU machine scripts/device/torchao_wheels.sh)"
    if gpus == 0:
        return "torchao's CPUOffloadOptimizer runs on a CUDA or XPU device only (its constructor asserts so)"
    if clip_asked:
        return f"{NAME} clips no gradients (its documented use): run it without --clip, or with --clip none"
    return None


def run_torchao(run: Any, family: type, model_kwargs: dict[str, Any], adamw: dict[str, Any], data: Any, *,
                recompute: type | None, accumulate: int, steps: int, warmup: int, batch: int, block_size: int,
                inexact_because: str | None) -> dict:
    """Train `warmup` + `steps` optimizer steps under CPUOffloadOptimizer and measure them: bench.py's entry."""
    import torch
    from torchao.optim import CPUOffloadOptimizer

    optimizer = functools.partial(CPUOffloadOptimizer, optimizer_class=torch.optim.AdamW, fused=True, **adamw)
    return train_plainly(run, family, model_kwargs, optimizer, data, recompute=recompute, accumulate=accumulate,
                         steps=steps, warmup=warmup, batch=batch, block_size=block_size,
                         inexact_because=inexact_because)


def train_plainly(run: Any, family: type, model_kwargs: dict[str, Any], optimizer_factory: Any, data: Any, *,
                  recompute: type | None, accumulate: int, steps: int, warmup: int, batch: int, block_size: int,
                  inexact_because: str | None) -> dict:
    """The loop of torchao's README on one device, timed with the device synchronized between phases: forward (batch
    start to the loss), backward (with the gradients' copies to the host that overlap it) and the optimizer step (the
    host's AdamW and the copies back), summed over the window's micro-batches."""
    import torch

    from zoffbench.recompute import recompute_blocks
    from zoffbench.recorders import process_peaks, synchronized_now

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with device:  # the documented use: the model where it trains, the optimizer keeps its copy on the host
        module = family(**model_kwargs, optimizer=optimizer_factory)
    recompute_blocks(module, recompute)
    params = sum(p.numel() for p in module.parameters())
    optimizer = module.configure_optimizers()
    data.setup("fit")
    batches = iter(data.train_dataloader())
    step_s, forward, backward, exposed = [], [], [], []
    first_step_at = time.time()
    for _ in range(warmup + steps):
        start = synchronized_now()
        forward_s = backward_s = 0.0
        for index in range(accumulate):
            x, y = (t.to(device, non_blocking=True) for t in next(batches))
            began = synchronized_now()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = module.training_step((x, y), index)
            computed = synchronized_now()
            (loss / accumulate).backward()
            forward_s, backward_s = forward_s + computed - began, backward_s + synchronized_now() - computed
        stepping = synchronized_now()
        optimizer.step()
        optimizer.zero_grad()
        end = synchronized_now()
        step_s.append(end - start)
        forward.append(forward_s)
        backward.append(backward_s)
        exposed.append(end - stepping)
    measured = slice(warmup, None)
    step, fwd, bwd = (statistics.median(v[measured]) for v in (step_s, forward, backward))
    update = statistics.median(exposed[measured])
    tokens_per_s = batch * accumulate * block_size / step
    measurement = StepMeasurement(
        step_s_median=step, step_s_mean=statistics.fmean(step_s[measured]), devices=1, rank=0,
        tokens_per_s=tokens_per_s, model_tflops=6 * params * tokens_per_s / 1e12, forward_s=fwd, backward_s=bwd,
        exposed_optimizer_s=update, other_s=step - fwd - bwd - update, gpu_busy_fraction=(fwd + bwd) / step,
        phase_source="synchronized loop", telemetry_median={}, gpu_gb_after_micro_backward=None,
        window_peak_gpu_gb=None, **process_peaks(),
        setup_s=first_step_at - psutil.Process().create_time(), reported_at=time.time(), params=params,
        steps=step_s, forward=forward, backward=backward, zoff_options={}, memory=None,
        inexact_because=inexact_because)
    return run.entry(**measurement.fields())
