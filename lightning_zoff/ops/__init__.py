"""Fused CPU optimizer kernels (csrc/), JIT-built on first use.

Each call is one sweep over contiguous CPU tensors on `threads` OpenMP threads with the GIL released: read the
gradient (fp32, bf16 or fp16), scale it, update the fp32 param and the moments (in place, or into the tensors given
as `into`, leaving the inputs untouched) and, if `out` is given, write the updated param rounded to nearest even into
that bf16/fp16 tensor (equal to `param.to(out.dtype)`; NaN stays NaN). The moments are fp32 or bf16 (all of one
call's alike, `into`'s too): bf16 ones are loaded into fp32, updated with the same fp32 math and stored rounded to
nearest even (equal to `.to(torch.bfloat16)` of the fp32 result; NaN stays NaN); the param is used in fp32 with the
unrounded moments. Arrays that are only written (`out`, and `into`) get non-temporal stores where aligned, which
skips reading their lines first; `stream=False` (or ZOFF_STREAM_STORES=0) turns that off. Nothing is copied:
non-contiguous, wrongly typed (a param that is not fp32, moments neither fp32 nor bf16 or of two dtypes) or
mis-sized tensors raise ValueError naming the tensor.
`isa=None` uses `selected_isa()`; `threads=None` uses `torch.get_num_threads()`."""

from __future__ import annotations

import os

import torch

from lightning_zoff.ops.build import load
from lightning_zoff.ops.dispatch import available_isas, default_threads, selected_isa

__all__ = [
    "accumulate", "adam_step", "available_isas", "grad_sumsq_finite", "lion_step", "load", "selected_isa",
    "stream_probe",
]


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled: bool,
    maximize: bool = False,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    stream: bool | None = None,
    isa: str | None = None,
    threads: int | None = None,
) -> None:
    """One torch.optim.Adam (`decoupled=False`) or AdamW (`decoupled=True`) step on `grad * grad_scale`.

    `step` counts this step, starting at 1. The math is torch's single-tensor Adam in fp32. `into`: (param,
    exp_avg, exp_avg_sq) to receive the updated state instead of the inputs.
    """
    load().adam_step(
        param, grad, exp_avg, exp_avg_sq, out, lr, beta1, beta2, eps, weight_decay, step, decoupled, maximize,
        grad_scale, _into(into), _stream(stream), _isa(isa), _threads(threads),
    )


def lion_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    maximize: bool = False,
    out: torch.Tensor | None = None,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
    stream: bool | None = None,
    isa: str | None = None,
    threads: int | None = None,
) -> None:
    """One Lion step on g = `grad * grad_scale`: c = beta1*m + (1-beta1)*g; p *= 1 - lr*weight_decay;
    p -= lr * sign(c) (sign(0) = 0, like torch.sign); m = beta2*m + (1-beta2)*g. `into`: (param, exp_avg) to
    receive the updated state instead of the inputs."""
    load().lion_step(
        param, grad, exp_avg, out, lr, beta1, beta2, weight_decay, grad_scale, maximize, _into(into), _stream(stream),
        _isa(isa), _threads(threads),
    )


def accumulate(dst: torch.Tensor, src: torch.Tensor, *, replace: bool = False, isa: str | None = None,
               threads: int | None = None) -> None:
    """`dst += src` for fp32/bf16/fp16 tensors of equal size, added in fp32 and rounded to dst's dtype: the same
    bits as `dst.add_(src)`, on this rank's kernel threads. `replace=True`: `dst.copy_(src)`."""
    load().accumulate(dst, src, replace, _isa(isa), _threads(threads))


def grad_sumsq_finite(
    grad: torch.Tensor, grad_scale: float = 1.0, isa: str | None = None, threads: int | None = None
) -> tuple[float, bool]:
    """(sum of squares, all finite) of the scaled gradient, read-only.

    The scaled value is `grad * grad_scale` computed in fp32, as the update kernels compute it: an fp16 gradient
    that leaves the fp16 range after scaling is finite; one that overflows fp32 is not. Squares are summed in
    double, so the sum stays accurate over billions of elements.
    """
    return load().grad_sumsq_finite(grad, grad_scale, _isa(isa), _threads(threads))


def stream_probe(nbytes: int = 1 << 28, threads: int | None = None, isa: str | None = None) -> dict[str, float]:
    """Host memory bandwidth in GB/s (bytes read + written) over three `nbytes` arrays: "read", "copy", "triad"
    and, where the ISA has non-temporal stores, "copy_nt" and "triad_nt". Best of a few repetitions."""
    return load().stream_probe(nbytes, _threads(threads), _isa(isa))


def _into(into: tuple[torch.Tensor, ...] | None) -> list[torch.Tensor] | None:
    return None if into is None else list(into)


def _stream(stream: bool | None) -> bool:
    return os.environ.get("ZOFF_STREAM_STORES", "1") != "0" if stream is None else stream


def _isa(isa: str | None) -> str:
    return selected_isa() if isa is None else isa


def _threads(threads: int | None) -> int:
    return default_threads() if threads is None else threads
