"""bench.py's run "zoff_fabric": the "zoff" run's model, data, AdamW, bf16-mixed, clipping at 1.0 and accumulation,
trained in a plain Fabric loop under `Fabric(strategy=ZoffFabricStrategy(...))` instead of the Trainer, measured the
same way (wall time per optimizer step with the GPU synchronized at its ends, zoff's own phase telemetry), so the two
front doors compare in one call: `python scripts/bench/bench.py --runs zoff zoff_fabric`."""

from __future__ import annotations

import statistics
import time
from math import nan
from typing import Any, cast

import psutil

from zoffbench.harness import StepMeasurement, clipped_fraction
from zoffbench.host_floor import host_floor
from zoffbench.recorders import (
    alloc_retries,
    expandable_segments_in_use,
    process_peaks,
    reserved_by_stream,
    retries_per_step,
    synchronized_now,
)


def run_fabric(run: Any, family: type, model_kwargs: dict[str, Any], adamw: dict[str, Any], options: dict[str, Any],
               data: Any, *, accumulate: int, steps: int, warmup: int, batch: int, devices: int, block_size: int,
               zoff_options: dict[str, Any], inexact_because: str | None, clip: float | None = 1.0) -> dict:
    """Train `warmup` + `steps` optimizer steps of `family(**model_kwargs, **adamw)` built on the meta device, on
    `data`, and measure them: this rank's entry of bench.py's JSON (`run`: its `BenchRun`)."""
    import torch
    from lightning.fabric import Fabric

    from lightning_zoff.fabric import ZoffFabricStrategy  # the door's module: lightning_zoff's lazy name is Any to mypy

    fabric = Fabric(accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=devices,
                    precision="bf16-mixed", strategy=ZoffFabricStrategy(**options))
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):  # each rank initialises only its own units
        module = family(**model_kwargs, **adamw)
    params = sum(p.numel() for p in module.parameters())
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    data.setup("fit")
    batches = iter(fabric.setup_dataloaders(data.train_dataloader()))
    step_s, telemetry, window_peak, retries = [], [], [], []
    first_step_at, retries_before_first = time.time(), alloc_retries()
    for _ in range(warmup + steps):
        start = synchronized_now()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        for micro in range(accumulate):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                _, loss = model(x, y)
                fabric.backward(loss / accumulate)
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()
        step_s.append(synchronized_now() - start)
        telemetry.append(dict(cast(ZoffFabricStrategy, fabric.strategy).telemetry))  # the strategy given Fabric
        if torch.cuda.is_available():
            window_peak.append(torch.cuda.max_memory_allocated() / 1e9)
            retries.append(alloc_retries())
    measured = step_s[warmup:]
    # zoff's phase times arrive a step late on CUDA (StepTimer): a step may lack them
    keys = {key for t in telemetry[warmup:] for key in t}
    norms = [t["zoff/grad_norm"] for t in telemetry if "zoff/grad_norm" in t]
    zoff = {key: statistics.median(t[key] for t in telemetry[warmup:] if key in t) for key in sorted(keys)}
    step = statistics.median(measured)
    tokens_per_s = devices * batch * accumulate * block_size / step
    forward, backward = zoff.get("zoff/forward_s", nan), zoff.get("zoff/backward_s", nan)
    exposed = zoff.get("zoff/exposed_optimizer_s", nan)
    measurement = StepMeasurement(
        step_s_median=step, step_s_mean=statistics.fmean(measured), devices=devices,
        rank=fabric.global_rank, tokens_per_s=tokens_per_s, model_tflops=6 * params * tokens_per_s / 1e12,
        forward_s=forward, backward_s=backward, exposed_optimizer_s=exposed,
        other_s=step - forward - backward - exposed, gpu_busy_fraction=(forward + backward) / step,
        phase_source="zoff telemetry",
        telemetry_median=zoff,
        gpu_gb_after_micro_backward=None,
        window_peak_gpu_gb=statistics.median(window_peak[warmup:]) if window_peak else None,
        **process_peaks(), gpu_expandable_segments=expandable_segments_in_use(),
        clipped_fraction=clipped_fraction(norms[warmup:], clip), grad_norms=norms,
        setup_s=first_step_at - psutil.Process().create_time(), reported_at=time.time(),
        host_floor=host_floor(fabric.strategy, zoff, step), params=params, steps=step_s,
        forward=[t.get("zoff/forward_s", 0.0) for t in telemetry],
        backward=[t.get("zoff/backward_s", 0.0) for t in telemetry], zoff_options=zoff_options,
        memory=cast(ZoffFabricStrategy, fabric.strategy).memory_report, inexact_because=inexact_because,
        gpu_alloc_retries_per_step=retries_per_step(retries, retries_before_first),
        gpu_reserved_by_stream=reserved_by_stream())
    return run.entry(**measurement.fields())
