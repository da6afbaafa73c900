"""One optimizer update of a contiguous fp32 run of parameters: the fused CPU kernel, or torch ops on an
accelerator (strategy "zoff_no_offload"). Both read the gradient in its own dtype times `grad_scale`, keep the moments
in fp32 or bf16 (updated in fp32, stored rounded to nearest even) and can write a 16-bit copy of the updated
parameter into `out`. `update_many` runs the torch ops over several runs at once."""

from __future__ import annotations

import time

import torch

from lightning_zoff import ops
from lightning_zoff._compat import fused_adam_step
from lightning_zoff.optim.rules import GroupHyperparams, UpdateRule


def update(
    rule: UpdateRule,
    hp: GroupHyperparams,
    step: int,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor | None,
    *,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    into: tuple[torch.Tensor, ...] | None = None,
    threads: int | None = None,
    on_host: bool | None = None,
) -> None:
    """`step` counts this step (1-based). `exp_avg_sq` is None for Lion. `into`: where the updated (param,
    exp_avg[, exp_avg_sq]) go instead of in place (CPU only: the engine's speculative updates). `on_host`: the fused
    CPU kernel (default: for CPU tensors) or torch ops (the accelerator's path, also runnable on CPU tensors)."""
    if param.device.type == "cpu" if on_host is None else on_host:
        _cpu_update(rule, hp, step, param, grad, exp_avg, exp_avg_sq, grad_scale, out, into, threads)
    else:
        if into is not None:
            raise ValueError("updating into other tensors is a CPU kernel feature; update accelerator state in place")
        _torch_update(rule, hp, step, param, grad, exp_avg, exp_avg_sq, grad_scale, out)


def _cpu_update(rule, hp, step, param, grad, exp_avg, exp_avg_sq, grad_scale, out, into, threads) -> None:
    if rule is UpdateRule.LION:
        ops.lion_step(param, grad, exp_avg, lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay,
                      grad_scale=grad_scale, maximize=hp.maximize, out=out, into=into, threads=threads)
    else:
        ops.adam_step(param, grad, exp_avg, exp_avg_sq, lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, eps=hp.eps,
                      weight_decay=hp.weight_decay, step=step, decoupled=rule is UpdateRule.ADAMW,
                      maximize=hp.maximize, grad_scale=grad_scale, out=out, into=into, threads=threads)


def _torch_update(rule, hp, step, param, grad, exp_avg, exp_avg_sq, grad_scale, out) -> None:
    if exp_avg.dtype != torch.float32:  # 16-bit moments: the step in fp32 on copies, stored rounded as the kernel does
        moments = [t for t in (exp_avg, exp_avg_sq) if t is not None]
        fp32 = [t.float() for t in moments]
        _torch_update(rule, hp, step, param, grad, fp32[0], fp32[1] if len(fp32) == 2 else None, grad_scale, out)
        for moment, updated in zip(moments, fp32, strict=True):
            moment.copy_(updated)
        return
    g = _scaled(grad.to(torch.float32, copy=True), hp, grad_scale)  # one fp32 temporary (the plan's workspace)
    if rule is UpdateRule.LION:
        direction = exp_avg.mul(hp.beta1).add_(g, alpha=1 - hp.beta1).sign_()
        param.mul_(1 - hp.lr * hp.weight_decay).add_(direction, alpha=-hp.lr)
        exp_avg.mul_(hp.beta2).add_(g, alpha=1 - hp.beta2)
    else:
        assert exp_avg_sq is not None
        _fused_adam(rule, hp, step, [param], [g], [exp_avg], [exp_avg_sq])
    if out is not None:
        out.copy_(param)


def update_many(rule: UpdateRule, hp: GroupHyperparams, step: int, params: list[torch.Tensor],
                grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor] | None, *,
                grad_scale: float = 1.0) -> None:
    """`update` on the accelerator's path (torch ops, in place) of several 1-D runs at once, the same bits as one
    call each: for Adam and AdamW with fp32 moments, one fp32 copy of all the gradients and one fused kernel call over
    them, as torch.optim's fused AdamW runs, where one call each launches four kernels a parameter (a step of a
    1B-parameter model at batch 1 waits for those launches, not for the GPU). The caller bounds the gradients'
    elements together: they are the fp32 workspace."""
    if not params:
        return
    if rule is UpdateRule.LION or exp_avgs[0].dtype != torch.float32 or exp_avg_sqs is None:
        for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
            _torch_update(rule, hp, step, param, grad, exp_avgs[i], None if exp_avg_sqs is None else exp_avg_sqs[i],
                          grad_scale, None)
        return
    sizes = [grad.numel() for grad in grads]
    g = torch.empty(sum(sizes), dtype=torch.float32, device=params[0].device)
    torch.cat([grad.reshape(-1) for grad in grads], out=g)  # cast as `grad.to(torch.float32)` casts each
    _fused_adam(rule, hp, step, params, list(_scaled(g, hp, grad_scale).split(sizes)), exp_avgs, exp_avg_sqs)


def _scaled(g: torch.Tensor, hp: GroupHyperparams, grad_scale: float) -> torch.Tensor:
    """The fp32 gradient `g` times `grad_scale`, negated to maximize, in place."""
    g.mul_(grad_scale)
    return g.neg_() if hp.maximize else g


def _fused_adam(rule: UpdateRule, hp: GroupHyperparams, step: int, params: list[torch.Tensor],
                grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor]) -> None:
    """torch's fused Adam or AdamW over fp32 tensors, `grads` scaled already; every tensor at `step`."""
    # made on the device by a fill: `torch.tensor(step, device=...)` copies from pageable host memory, which waits
    # for the stream's work first (a synchronize a call, each step)
    step_tensor = torch.full((), float(step), dtype=torch.float32, device=params[0].device)
    fused_adam_step(decoupled=rule is UpdateRule.ADAMW)(
        params, grads, exp_avgs, exp_avg_sqs, [], [step_tensor] * len(params), lr=hp.lr, beta1=hp.beta1,
        beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps, amsgrad=False, maximize=False, grad_scale=None,
        found_inf=None)


def host_update_seconds_per_element(moment_dtype: torch.dtype, threads: int | None = None, elements: int = 1 << 24,
                                    repeats: int = 5) -> float:
    """The fused AdamW kernel's time per element on `threads` of this host, now: the fastest of `repeats` updates of
    `elements`, after one that touches the pages. "auto" weighs recompute with it. 16M elements (224 MB with fp32
    moments, ~5 ms an update) stream from memory as a step's state does; 4M (56 MB) can sit in a server's last-level
    cache (the 2-core dev box, 32 MB of it: 0.31 ns an element at 4M, 0.43-0.51 at 16M-64M; the H100 box's steps
    update at 0.30-0.36)."""
    param = torch.zeros(elements)
    grad = torch.zeros(elements, dtype=torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros(elements, dtype=moment_dtype), torch.zeros(elements, dtype=moment_dtype)
    hp = GroupHyperparams(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False)
    best = float("inf")
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        _cpu_update(UpdateRule.ADAMW, hp, 1, param, grad, exp_avg, exp_avg_sq, 1.0, None, None, threads)
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best / elements
