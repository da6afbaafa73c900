"""What the engine moved, spent and holds: per-step traffic counters and the memory report."""

from __future__ import annotations

import threading
from typing import cast

import torch
from torch.distributed.tensor import DTensor

from lightning_zoff.offload.unit_state import Placement, UnitState


class Traffic:
    """What the optimizer steps moved and cost on the host side since the last `take_traffic`."""

    def __init__(self) -> None:
        self.d2h_bytes = self.h2d_bytes = 0
        self.cpu_update_s = 0.0  # update kernels, speculative ones included
        self.speculations_kept = self.speculations_redone = 0
        self._lock = threading.Lock()  # the worker and the training thread both count

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)


def memory_report(units: list[UnitState], *, grad_sum_dtype: torch.dtype, accumulate_on_accelerator: bool,
                  sums_windows: bool, retain_device_sum: bool, spare_bytes: int) -> dict[str, float]:
    """Bytes this rank holds, by kind, and per parameter element of its shard (and per trained element: only the
    parameters the optimizer trains have state)."""
    locals_ = [cast(DTensor, p).to_local() for u in units for p in u.layout.params]
    local_numel = sum(t.numel() for t in locals_)
    accel_params = sum(t.numel() * t.element_size() for t in locals_)
    trained_numel = sum(p.slot.numel for u in units for p in u.trained)
    on_host = [u for u in units if u.placement is Placement.HOST]
    host = {
        "host_master": sum(u.master.nbytes for u in on_host),
        "host_optimizer_state": sum(t.nbytes for u in on_host for t in u.state[1:]),
        "host_spare_state": spare_bytes,  # overlap's spare pool
        "host_grad_sum": sum(u.grad_sum.nbytes for u in on_host if u.grad_sum is not None),
        "host_staging": sum(u.grad_staging.nbytes + (0 if u.fp32_params else u.param_staging.nbytes) for u in on_host),
    }
    host_total = sum(host.values())
    sum_bytes = [u.layout.flat_numel * grad_sum_dtype.itemsize for u in units]
    if not (accumulate_on_accelerator and sums_windows):
        accel_sum = 0
    elif retain_device_sum:
        accel_sum = sum(sum_bytes)  # every unit's buffer for the whole window
    else:
        accel_sum = max(sum_bytes, default=0)  # one unit's, while its backward runs
    return {
        "local_params": local_numel,
        "trained_params": trained_numel,
        "accelerator_params": accel_params,
        # the largest unit's reduced gradient lives on the accelerator only until it reaches the host
        "accelerator_grad_peak": max((u.layout.flat_numel * u.grad_staging.element_size() for u in units), default=0),
        "accelerator_grad_sum": accel_sum,
        # the state and buffers of the units placed there (accelerator_state)
        "accelerator_optimizer_state": sum(t.nbytes for u in units if u.placement is Placement.ACCELERATOR
                                           for t in u.buffers()),
        **host,
        "host_total": host_total,
        "accelerator_bytes_per_param": accel_params / max(local_numel, 1),
        "host_bytes_per_param": host_total / max(local_numel, 1),
        "host_bytes_per_trained_param": host_total / max(trained_numel, 1),
    }


def describe_memory(report: dict[str, float]) -> str:
    """One line: sizes in MiB, ratios in bytes per parameter element."""
    parts = []
    for key, value in report.items():
        if key in ("local_params", "trained_params"):
            parts.append(f"{key}={int(value):,}")
        elif "_per_" in key:
            parts.append(f"{key}={value / 1:.2f}")
        else:
            parts.append(f"{key}={value / 2**20:.1f} MiB")
    return ", ".join(parts)
