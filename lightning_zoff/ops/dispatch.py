"""Which kernel build runs: the best one this CPU supports, unless the ZOFF_ISA environment variable names one."""

from __future__ import annotations

import functools
import os
import warnings

import torch

from lightning_zoff.ops.build import load


def available_isas() -> list[str]:
    """The kernel builds this CPU runs, best first ("avx512", "avx2", "scalar"); always ends with "scalar"."""
    return list(_detected())


def selected_isa() -> str:
    """ZOFF_ISA if set (it must be one of `available_isas()`), else the best available build."""
    choices = available_isas()
    forced = os.environ.get("ZOFF_ISA")
    if forced:
        if forced not in choices:
            raise ValueError(f"ZOFF_ISA={forced!r} is not an ISA this CPU runs; choose one of: {', '.join(choices)}")
        return forced
    if choices[0] == "scalar":
        _warn_scalar_only()
    return choices[0]


def default_threads() -> int:
    """The kernels' thread count when a call does not give one: torch's intra-op thread count."""
    return torch.get_num_threads()


@functools.cache
def _detected() -> tuple[str, ...]:
    # Asked of the compiled module: the same check guards every call, so the list and the guard cannot disagree.
    return tuple(load().available_isas())


@functools.cache
def _warn_scalar_only() -> None:
    warnings.warn(
        "this CPU has no AVX2: lightning_zoff's optimizer kernels run their portable scalar path, which is several"
        " times slower than the SIMD ones",
        stacklevel=3,
    )
