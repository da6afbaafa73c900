"""Where a unit's state lives on the host: buffers mapped by zoff itself, kept out of forked children, in huge pages,
and pinned when possible.

Each host buffer is its own anonymous mapping of whole pages (`mmap`), of its exact size:
- ``MADV_DONTFORK``: a fork of the training process (every DataLoader worker is one; so is `subprocess` before its
  exec) does not inherit it. Linux copies pinned pages into the child at the fork itself (20 GB: 6.7 s and +20 GB per
  worker, measured on the 1x H200 box) and pageable ones when the parent rewrites them, which the update does every
  step; Llama-3-8B with 2 workers was killed by the OOM killer. A mapping of zoff's own, not pages of malloc's heap:
  those are handed to other objects once freed, which a child could then no longer read.
- ``MADV_HUGEPAGE``, before the first touch: the update kernels stream through every byte of the host state each step;
  with 4 KiB pages that is a TLB miss per page and stream. Large mappings start on a 2 MiB boundary for it.
- Pinned (`cudaHostRegister`) when asked and the OS allows it, else pageable with one warning: only pinned memory
  copies asynchronously at full PCIe speed. torch's pinned allocator would round each buffer up to a power of two (a
  630 MB unit buffer takes 1 GiB) and cache freed blocks, so the plan would not be what the process holds.
The mapping lives as long as the tensor's storage (views included): it is unregistered, then unmapped, after the last.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import resource
import sys
import warnings
import weakref

import torch

_HUGE_PAGE = 2 << 20
_PAGE = mmap.PAGESIZE
_MADV_DONTFORK = 10  # linux/mman.h
_MADV_HUGEPAGE = 14
_MAP_FAILED = ctypes.c_void_p(-1).value

_warned_pageable = False
_warned_inherited = False
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
if _libc is not None:
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

_live: dict[int, int] = {}  # start -> length of every mapping alive: `mapped_ranges`
_mappings: weakref.WeakValueDictionary[int, _Pages] = weakref.WeakValueDictionary()  # start -> mapping: `is_pinned`


def _memlock_limit() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MiB"


def host_empty(numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """An uninitialised flat tensor on `device`; on the host in a mapping of its own (see above), pinned if `pin` and
    the OS allows it, else pageable with a warning."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    nbytes = numel * dtype.itemsize
    if nbytes == 0 or _libc is None:
        if nbytes:
            _warn_inherited("this OS has no madvise")
        return torch.empty(numel, dtype=dtype)
    pages = _map(nbytes)
    tensor = torch.frombuffer(pages, dtype=dtype, count=numel)  # the storage keeps `pages` alive
    if pin and torch.cuda.is_available():
        error = pages.register()
        if error is not None:
            _warn_pageable(error)
    return tensor


def is_pinned(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lies in a mapping of `host_empty`'s that is pinned."""
    pages = _mappings.get(tensor.untyped_storage().data_ptr())
    return pages is not None and pages.registered


def mapped_ranges() -> list[tuple[int, int]]:
    """The [start, end) address ranges of the host buffers alive now."""
    return [(start, start + length) for start, length in _live.items()]


class _Pages(ctypes.Array):  # type: ignore[type-arg]
    """Base of the mapping types: `_type_` and `_length_` come from `_pages_type`."""

    _type_ = ctypes.c_ubyte
    _length_ = 0
    registered = False

    def register(self) -> str | None:
        """Pin the mapping until it is unmapped; None, or why it could not."""
        cudart = torch.cuda.cudart()
        status = cudart.cudaHostRegister(ctypes.addressof(self), len(self), 0)
        if int(status) != 0:
            clear_last_error = getattr(cudart, "cudaGetLastError", None)
            if clear_last_error is not None:  # or a later kernel launch check reports this failure as its own
                clear_last_error()
            return f"cudaHostRegister returned {status}"
        self.registered = True
        return None

    def __del__(self) -> None:  # after the last storage that views it: unpinned first, then unmapped
        start = ctypes.addressof(self)
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(start)
        _live.pop(start, None)
        assert _libc is not None
        _libc.munmap(start, len(self))


@functools.cache
def _pages_type(length: int) -> type[_Pages]:
    return type("HostPages", (_Pages,), {"_length_": length, "_type_": ctypes.c_ubyte})


def _map(nbytes: int) -> _Pages:
    """A private anonymous mapping of whole pages holding `nbytes`, advised as the module says."""
    assert _libc is not None
    length = -(-nbytes // _PAGE) * _PAGE
    slack = _HUGE_PAGE if length >= _HUGE_PAGE else 0  # to start on a huge page's boundary
    raw = _libc.mmap(None, length + slack, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if raw is None or raw == _MAP_FAILED:
        raise torch.OutOfMemoryError(f"zoff: the OS refused {nbytes} bytes of host memory"
                                     f" (errno {ctypes.get_errno()})")
    start = -(-raw // _HUGE_PAGE) * _HUGE_PAGE if slack else raw
    if start > raw:
        _libc.munmap(raw, start - raw)
    if raw + slack > start:
        _libc.munmap(start + length, raw + slack - start)
    if _libc.madvise(start, length, _MADV_DONTFORK) != 0:
        _warn_inherited(f"madvise(MADV_DONTFORK) failed with errno {ctypes.get_errno()}")
    _libc.madvise(start, length, _MADV_HUGEPAGE)  # best effort: the memory works the same without
    _live[start] = length
    pages = _pages_type(length).from_address(start)
    _mappings[start] = pages
    return pages


def _warn_inherited(why: str) -> None:
    global _warned_inherited
    if not _warned_inherited:
        _warned_inherited = True
        warnings.warn(f"zoff cannot keep its host buffers out of forked processes ({why}): each DataLoader worker"
                      " may copy the optimizer state as the update rewrites it. Use num_workers=0, or"
                      " multiprocessing_context='spawn' for the DataLoader.", stacklevel=3)


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

