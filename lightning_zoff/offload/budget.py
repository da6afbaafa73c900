"""Host memory a rank's engine will hold, checked against the machine before any of it is allocated."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("lightning_zoff")


def host_bytes_per_element(*, param_bytes: int, second_moment: bool, overlap: bool, accum_bytes: int,
                           moment_bytes: int = 4) -> int:
    """Host bytes per element of a rank's flat shard: fp32 master and the moments (`moment_bytes` each; and their
    spare copy with overlap), the window's gradient sum (`accum_bytes`: 0 when every window is one micro-batch, whose
    gradient the kernel reads from the staging buffer), and the staging buffers the copies land in and leave from."""
    state = 4 + moment_bytes * (2 if second_moment else 1)
    staging = param_bytes + (0 if param_bytes == 4 else param_bytes)  # fp32 params go back from the master itself
    return state * (2 if overlap else 1) + accum_bytes + staging


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_budget(elements: int, ranks_on_node: int, *, param_bytes: int, second_moment: bool, overlap: bool,
                      accum_bytes: int, moment_bytes: int) -> None:
    """Refuse a model whose host state cannot fit in this machine's memory, naming the bytes and what would fit;
    warn when it exceeds what is free now. ZOFF_HOST_MEMORY_BYTES overrides the machine's total (tests, shared
    hosts)."""
    options = dict(param_bytes=param_bytes, second_moment=second_moment, overlap=overlap, accum_bytes=accum_bytes,
                   moment_bytes=moment_bytes)

    def needs(**change: object) -> int:  # bytes on this node, with some options changed
        return elements * ranks_on_node * host_bytes_per_element(**{**options, **change})

    per_element = host_bytes_per_element(**options)
    needed = needs()
    total = int(os.environ.get("ZOFF_HOST_MEMORY_BYTES", 0)) or _meminfo_bytes("MemTotal")
    if total is None:
        return
    gb = 1e9
    if needed > total:
        smaller, together = [], {}
        if overlap:
            smaller.append(f"overlap=False ({needs(overlap=False) / gb:.1f} GB)")
            together["overlap"] = False
        if moment_bytes == 4:
            smaller.append(f"optimizer_state_dtype='bf16' ({needs(moment_bytes=2) / gb:.1f} GB)")
            together["moment_bytes"] = 2
        if accum_bytes == 4 and param_bytes == 2:
            smaller.append(f"grad_accum_dtype='bf16' or 'fp16' ({needs(accum_bytes=2) / gb:.1f} GB)")
            together["accum_bytes"] = 2
        if len(together) > 1:
            smaller.append(f"all of these ({needs(**together) / gb:.1f} GB)")
        smaller.append("more nodes (the host state splits across all ranks)")
        raise MemoryError(
            f"zoff: the optimizer state needs {needed / gb:.1f} GB of host memory on this node ({ranks_on_node} rank(s)"
            f" x {elements:,} elements x {per_element} B) but the machine has {total / gb:.1f} GB. Options: "
            + "; ".join(smaller) + "."
        )
    available = _meminfo_bytes("MemAvailable")
    if available is not None and needed > available:
        log.warning("zoff: the optimizer state needs %.1f GB of host memory on this node, more than the %.1f GB free now",
                    needed / gb, available / gb)
