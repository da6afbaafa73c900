"""The C allocator of a rank that runs FSDP2 on the CPU."""

from __future__ import annotations

import ctypes
import os

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)
_MMAP_THRESHOLD = 128 * 1024  # glibc's own initial value


def fix_mmap_threshold() -> None:
    """Keep glibc serving every allocation of 128 KiB or more with a mapping of its own, given back to the OS when
    freed, as it does until the first such block is freed. Left alone: a threshold the user set
    (`MALLOC_MMAP_THRESHOLD_`, or `glibc.malloc.mmap_threshold` in `GLIBC_TUNABLES`), and C libraries other than
    glibc (no `mallopt`).

    After that free, glibc raises its threshold to the freed block's size (up to 32 MiB) and takes later blocks up to
    that size from its heap. FSDP2 on the CPU allocates and frees every unit's all-gather buffer and unsharded
    parameters (megabytes each) in every forward; in the heap, between activations of changing sizes, they fragment
    it and it grows without end (no-grad forwards of a growing input: by about a unit's size per forward; under DDP,
    which frees nothing of that size, not at all). With the threshold fixed the heap stays flat, and every such buffer
    costs page faults instead (bench/README.md, "Sampling and no-grad forwards on CPU", has the numbers).
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
