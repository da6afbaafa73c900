"""A zoff run's host update against the machine's floor, measured after training: shared by the Trainer's runs
(runs.py) and the Fabric loop's (fabric_run.py)."""

from __future__ import annotations

from typing import Any


def host_floor(strategy: Any, telemetry: dict[str, float], step_s: float) -> dict[str, float] | None:
    """A zoff run's host update against the host's floor: the bytes its kernels move per second (each host parameter's
    gradient read, master and moments read and written, 16-bit copy written) beside the copy bandwidth this machine's
    cores reach on the kernels' threads (measured now, after training), and PCIe's bytes per second of step."""
    engine = getattr(strategy, "engine", None)
    if engine is None or "zoff/cpu_update_s" not in telemetry:
        return None
    from lightning_zoff import ops
    from lightning_zoff.placement import Placement

    host = [u for u in engine.units if u.placement is Placement.HOST and u.trained]
    probe = ops.stream_probe(nbytes=1 << 29, threads=engine.threads)
    copy = max(probe["copy"], probe.get("copy_nt", 0.0))
    floor = {"host_copy_gb_s": copy, "pcie_gb_s": (telemetry.get("zoff/d2h_gb", 0.0)
                                                   + telemetry.get("zoff/h2d_gb", 0.0)) / step_s}
    if host and telemetry["zoff/cpu_update_s"] > 0:
        unit = host[0]
        per_param = 2 * sum(t.element_size() for t in unit.state) + 2 * unit.param_dtype.itemsize
        # the host's kernels updated all but what the GPU took (`accelerator_update_share`), a median step's
        params = sum(u.master.numel() for u in host) - int(telemetry.get("zoff/lent_elements", 0))
        update = params * per_param / telemetry["zoff/cpu_update_s"] / 1e9
        floor |= {"host_params": params, "host_update_gb_s": update, "host_update_of_copy": update / copy}
    return floor
