"""AdamW, Adam and Lion whose step is one fused pass of the csrc/ kernels over each CPU parameter.

Real `torch.optim.Optimizer`s: param groups, LR schedulers and `state_dict` behave as torch's (per-parameter
state `step`, `exp_avg`, `exp_avg_sq`). Parameters must be contiguous fp32 CPU tensors; gradients may be fp32,
bf16 or fp16 (on torch >= 2.10 an fp32 parameter takes a 16-bit `.grad` after `p.grad_dtype = None`).
Under strategy="zoff" the engine runs the same kernels on its host shards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import overload

import torch
from typing_extensions import override

from lightning_zoff.optim.rules import GroupHyperparams, UpdateRule
from lightning_zoff.optim.update import update


class FusedCpuOptimizer(torch.optim.Optimizer):
    rule: UpdateRule

    def __init__(self, params: Iterable, defaults: dict, threads: int | None) -> None:
        super().__init__(params, defaults)
        self.threads = threads

    def _state_for(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            if self.rule is not UpdateRule.LION:
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @override
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hp = GroupHyperparams.of(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.device.type != "cpu" or p.dtype != torch.float32:
                    raise TypeError(
                        f"{type(self).__name__} updates fp32 CPU parameters; got {p.dtype} on {p.device}."
                        " Use strategy='zoff' for accelerator models, or torch.optim for GPU parameters."
                    )
                state = self._state_for(p)
                state["step"] += 1
                update(self.rule, hp, int(state["step"].item()), p, p.grad, state["exp_avg"],
                       state.get("exp_avg_sq"), threads=self.threads)
        return loss


class AdamW(FusedCpuOptimizer):
    rule = UpdateRule.ADAMW

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, maximize: bool = False, *,
                 threads: int | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, threads)


class Adam(FusedCpuOptimizer):
    rule = UpdateRule.ADAM

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, maximize: bool = False, *,
                 threads: int | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, threads)


class Lion(FusedCpuOptimizer):
    """Lion (Chen et al. 2023): update = sign(beta1*m + (1-beta1)*g), decoupled decay, m = beta2*m + (1-beta2)*g."""

    rule = UpdateRule.LION

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, maximize: bool = False, *, threads: int | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, threads)
