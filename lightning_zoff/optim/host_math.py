"""The host kernels' update in torch ops, operation for operation, so it runs on any device with the host's bits: the
accelerator's share of the host units' updates (`offload/lending.py`) then leaves the state exactly as the host would,
whichever units a step lends, and a run or its resume does not depend on that split.

Why each line is as it is: the kernels (`csrc/kernel_bodies.h`) compute in fp32 one operation at a time (built with
``-ffp-contract=off``: no fused multiply-add), from constants computed in double and rounded to fp32 once
(`csrc/step_consts.h`, mirrored by `_adam_consts` and `_lion_consts`); IEEE rounds each of +, -, *, / and sqrt the same
on every device. So here every torch op is one of those operations, in the kernels' order: no `alpha=` other than 1
(a multiply-add there may fuse), and divisors are tensors, since a GPU divides by a host scalar as a multiplication by
its reciprocal. torch's fp32 square root on the CPU is not correctly rounded (measured: 18% of random inputs differ);
in fp64, rounded once to fp32, it is exactly fp32's (53 >= 2 x 24 + 2 bits: the double rounding is innocuous). 16-bit
moments are computed in fp32 and stored rounded to nearest even, as the kernels store them.

Workspace, per element of the update (`workspace_bytes`; the plan's `StateOptions.lend_workspace_bytes` holds the
same): the fp32 gradient, one fp32 temporary, the square root's fp64 temporary, and fp32 copies of 16-bit moments;
carved from the caller's `work` buffer, so the accelerator allocates nothing per update.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from lightning_zoff.optim.rules import GroupHyperparams, UpdateRule


def _f32(x: float) -> float:
    """`x` rounded to the nearest fp32 (as C++'s `float(x)`)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class _AdamConsts:
    grad_scale: float
    l2: bool
    weight_decay: float
    decoupled_decay: bool
    decay: float
    lerp_from_m: bool
    lerp_w: float
    lerp_w_comp: float
    beta2: float
    one_minus_beta2: float
    bc2_sqrt: float
    eps: float
    neg_step_size: float


def _adam_consts(hp: GroupHyperparams, step: int, decoupled: bool, grad_scale: float) -> _AdamConsts:
    bias_correction1 = 1.0 - math.pow(hp.beta1, float(step))
    bias_correction2 = 1.0 - math.pow(hp.beta2, float(step))
    w = _f32(1.0 - hp.beta1)
    return _AdamConsts(
        grad_scale=_f32(-grad_scale if hp.maximize else grad_scale), l2=not decoupled and hp.weight_decay != 0.0,
        weight_decay=_f32(hp.weight_decay), decoupled_decay=decoupled and hp.weight_decay != 0.0,
        decay=_f32(1.0 - hp.lr * hp.weight_decay), lerp_from_m=w < 0.5, lerp_w=w,
        lerp_w_comp=_f32(1.0 - w),  # exact in double, then rounded: fp32's 1.0f - w
        beta2=_f32(hp.beta2), one_minus_beta2=_f32(1.0 - hp.beta2), bc2_sqrt=_f32(math.sqrt(bias_correction2)),
        eps=_f32(hp.eps), neg_step_size=_f32(-(hp.lr / bias_correction1)))


WORKSPACE_BYTES = 4 + 4 + 8  # per element: the fp32 gradient, an fp32 temporary, the square root's fp64 one


def workspace_bytes(moment_bytes: int, moments: int) -> int:
    """Bytes per element of `update_as_host`'s `work`: besides `WORKSPACE_BYTES`, fp32 copies of 16-bit moments."""
    return WORKSPACE_BYTES + (4 * moments if moment_bytes != 4 else 0)


def update_as_host(rule: UpdateRule, hp: GroupHyperparams, step: int, param: torch.Tensor, grad: torch.Tensor,
                   exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor | None, *, grad_scale: float = 1.0,
                   work: torch.Tensor | None = None) -> None:
    """One update of fp32 `param` and the moments (fp32 or bf16) in place, from `grad` (any float dtype) times
    `grad_scale`, with the bits `ops.adam_step` / `ops.lion_step` give; `step` counts this step (1-based). `work`: a
    uint8 buffer on the same device of at least `workspace_bytes` per element for the temporaries (else allocated)."""
    n = param.numel()
    moments = [exp_avg] if exp_avg_sq is None else [exp_avg, exp_avg_sq]
    per_element = workspace_bytes(moments[0].element_size(), len(moments))
    if work is None:
        work = torch.empty(n * per_element, dtype=torch.uint8, device=param.device)
    widened = len(moments) if per_element > WORKSPACE_BYTES else 0  # 16-bit moments, computed in fp32 copies
    g, d, wide, *copies = _carve(work, n, [torch.float32, torch.float32, torch.float64] + [torch.float32] * widened)
    fp32 = [copy.copy_(m) for m, copy in zip(moments, copies, strict=True)] if copies else moments
    g.copy_(grad)  # exact: any float gradient dtype widens to fp32 without rounding
    if rule is UpdateRule.LION:
        _lion(hp, param, g, fp32[0], grad_scale, d, wide.view(torch.float32)[:n])
    else:
        _adam(_adam_consts(hp, step, rule is UpdateRule.ADAMW, grad_scale), param, g, fp32[0], fp32[1], d, wide)
    for moment, computed in zip(moments, fp32, strict=True):
        if computed is not moment:
            moment.copy_(computed)  # rounded to nearest even


def _carve(work: torch.Tensor, n: int, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Tensors of `n` elements of each dtype, one after the other in `work` (widest first keeps each aligned)."""
    tensors, offset = [], 0
    for dtype in sorted(dtypes, key=lambda t: -t.itemsize):
        size = n * dtype.itemsize
        tensors.append((dtype, work[offset : offset + size].view(dtype)))
        offset += size
    if offset > work.numel():
        raise ValueError(f"update_as_host: a workspace of {work.numel()} bytes for {n} elements; {offset} needed")
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for dtype, tensor in tensors:
        by_dtype.setdefault(dtype, []).append(tensor)
    return [by_dtype[dtype].pop(0) for dtype in dtypes]


def _adam(k: _AdamConsts, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, d: torch.Tensor,
          wide: torch.Tensor) -> None:
    """`g`: the gradient in fp32, overwritten; `d` (fp32) and `wide` (fp64): temporaries."""
    g.mul_(k.grad_scale)
    if k.l2:
        g.add_(torch.mul(p, k.weight_decay, out=d))
    if k.decoupled_decay:
        p.mul_(k.decay)
    torch.sub(g, m, out=d)
    if k.lerp_from_m:
        m.add_(d.mul_(k.lerp_w))
    else:
        torch.sub(g, d.mul_(k.lerp_w_comp), out=m)
    v.mul_(k.beta2).add_(d.copy_(g).mul_(k.one_minus_beta2).mul_(g))  # beta2 * v + (1 - beta2) * g * g
    # the divisor made on the device by a fill: a host value copied up would wait for the stream's work first
    bc2_sqrt = torch.full((), k.bc2_sqrt, dtype=torch.float32, device=v.device)
    denom = g.copy_(wide.copy_(v).sqrt_()).div_(bc2_sqrt).add_(k.eps)
    p.add_(torch.mul(m, k.neg_step_size, out=d).div_(denom))


def _lion(hp: GroupHyperparams, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, grad_scale: float,
          d: torch.Tensor, e: torch.Tensor) -> None:
    """`g`: the gradient in fp32, overwritten; `d` and `e` (fp32): temporaries."""
    g.mul_(_f32(-grad_scale if hp.maximize else grad_scale))
    direction = torch.mul(m, _f32(hp.beta1), out=d).add_(torch.mul(g, _f32(1.0 - hp.beta1), out=e))
    if hp.weight_decay != 0.0:
        p.mul_(_f32(1.0 - hp.lr * hp.weight_decay))
    p.sub_(direction.sign_().mul_(_f32(hp.lr)))
    m.mul_(_f32(hp.beta2)).add_(g.mul_(_f32(1.0 - hp.beta2)))
