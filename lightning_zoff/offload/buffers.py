"""Host buffers: pinned when possible, because only pinned memory copies asynchronously at full PCIe speed."""

from __future__ import annotations

import resource
import warnings

import torch

_warned_pageable = False


def _memlock_limit() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MiB"


def host_empty(numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """An uninitialised flat tensor on `device`; pinned if `pin` and the OS allows it, else pageable with a warning."""
    if device.type != "cpu" or not pin or not torch.cuda.is_available():
        return torch.empty(numel, dtype=dtype, device=device)
    try:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    except RuntimeError as err:
        global _warned_pageable
        if not _warned_pageable:
            _warned_pageable = True
            warnings.warn(
                f"zoff could not pin host memory ({err}); the memlock limit is {_memlock_limit()}. Falling back to"
                " pageable memory: copies between GPU and host become synchronous and several times slower."
                " Raise the limit (`ulimit -l unlimited`, or `--ulimit memlock=-1` for containers) to fix it.",
                stacklevel=2,
            )
        return torch.empty(numel, dtype=dtype)


def record_event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event at the current end of `stream`'s work (None without a CUDA stream: CPU copies are synchronous)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
