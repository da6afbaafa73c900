"""Host buffers: pinned when possible, because only pinned memory copies asynchronously at full PCIe speed.

Pinned buffers are plain host allocations of their exact size, registered with CUDA (`cudaHostRegister`) and
unregistered when freed. torch's pinned allocator would round each one up to a power of two (a 630 MB unit buffer
takes 1 GiB) and keep freed blocks cached, so the memory plan would not be what the process holds, and a unit moved to
the accelerator would not give its host memory back to the OS.
"""

from __future__ import annotations

import ctypes
import mmap
import resource
import warnings
import weakref

import torch

_warned_pageable = False
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_madvise = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None)


def _memlock_limit() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MiB"


def host_empty(numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """An uninitialised flat tensor on `device`; on the host in huge pages where the OS gives them, and pinned if `pin`
    and the OS allows it, else pageable with a warning."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    tensor = torch.empty(numel, dtype=dtype)
    _ask_for_huge_pages(tensor)
    if not pin or not torch.cuda.is_available() or tensor.nbytes == 0:
        return tensor
    error = _register(tensor)
    if error is not None:
        _warn_pageable(error)
    return tensor


def _ask_for_huge_pages(tensor: torch.Tensor) -> None:
    """Before the first touch: back the tensor's whole 2 MiB pages with transparent huge pages where the OS gives them
    only on request (`madvise` mode). The update kernels stream through every byte of the host state each step: with
    4 KiB pages that is a TLB miss per page and stream. Best effort, silent: the memory works the same without."""
    start = -tensor.data_ptr() % _HUGE_PAGE + tensor.data_ptr()
    end = (tensor.data_ptr() + tensor.nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if _madvise is not None and end > start and mmap.PAGESIZE < _HUGE_PAGE:
        _madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)


def _register(tensor: torch.Tensor) -> str | None:
    """Pin `tensor`'s pages until the tensor object is freed; None, or why it could not."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = tensor.data_ptr(), tensor.nbytes
    status = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(status) != 0:
        clear_last_error = getattr(cudart, "cudaGetLastError", None)
        if clear_last_error is not None:  # or a later kernel launch check reports this failure as its own
            clear_last_error()
        return f"cudaHostRegister returned {status}"
    # weakref callbacks run before the tensor's memory is freed: the pages are unpinned first, then returned
    weakref.finalize(tensor, cudart.cudaHostUnregister, ptr)
    return None


def _warn_pageable(error: str) -> None:
    global _warned_pageable
    if not _warned_pageable:
        _warned_pageable = True
        warnings.warn(
            f"zoff could not pin host memory ({error}); the memlock limit is {_memlock_limit()}. Falling back to"
            " pageable memory: copies between GPU and host become synchronous and several times slower."
            " Raise the limit (`ulimit -l unlimited`, or `--ulimit memlock=-1` for containers) to fix it.",
            stacklevel=3,
        )


def record_event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event at the current end of `stream`'s work (None without a CUDA stream: CPU copies are synchronous)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
