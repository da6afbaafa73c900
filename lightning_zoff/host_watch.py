"""The host's memory while training: when the memory available on the host falls under a floor, zoff stops the run
itself at the next step, on every rank at once, with one line that says where the memory went, before the OS's OOM
killer ends the process tree (and, with it, a checkpoint being written). The floor sits far below what the plan keeps
free (`placement.machine.Machine.host_kept`): it is reached only when something outside the plan grows."""

from __future__ import annotations

import psutil

GiB = 2**30


class HostMemoryLow(MemoryError):
    """The host ran short of memory while training; the message says what holds it and what to change."""


def floor_bytes(configured_gb: float | None) -> int:
    """The floor: `configured_gb` (the `host_memory_floor` option), else 2% of the host's memory, at least 0.5 GiB."""
    if configured_gb is not None:
        return int(configured_gb * 1e9)
    return max(GiB // 2, int(0.02 * psutil.virtual_memory().total))


def available_bytes() -> int:
    return int(psutil.virtual_memory().available)


def stop_line(step: int, available: int, floor: int, planned: int) -> str:
    """What the run says when it stops: the memory, this rank's process tree, what to change."""
    rank = psutil.Process()
    workers = rank.children(recursive=True)
    workers_rss = sum(_rss(p) for p in workers)
    tree = _rss(rank) + workers_rss
    return (f"zoff: stopped the run at step {step}: the host has {available / 1e9:.1f} GB available, under the floor"
            f" of {floor / 1e9:.1f} GB (host_memory_floor); this rank's process tree holds {tree / 1e9:.1f} GB (the"
            f" rank {_rss(rank) / 1e9:.1f} GB with zoff's {planned / 1e9:.1f} GB planned, {len(workers)} child"
            f" process(es) {workers_rss / 1e9:.1f} GB), the host {psutil.virtual_memory().used / 1e9:.1f} GB in all."
            " Fewer DataLoader workers, optimizer_state_dtype='bf16' or accelerator_state=<a larger fraction> leave the"
            " host more room; the last checkpoint written is intact.")


def _rss(process: psutil.Process) -> int:
    try:
        return int(process.memory_info().rss)
    except psutil.Error:  # it ended meanwhile
        return 0
