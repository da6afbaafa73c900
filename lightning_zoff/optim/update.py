"""The update of one contiguous run of parameters that share a param group.

Until the fused kernels of csrc/ land, this uses torch's own fused Adam/AdamW ops, which run on CPU and CUDA.
"""

from __future__ import annotations

import torch

from lightning_zoff.optim.rules import GroupHyperparams, UpdateRule


def adam_update(
    rule: UpdateRule,
    hp: GroupHyperparams,
    step: int,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
) -> None:
    """One Adam/AdamW step in place on fp32 `param`, `exp_avg`, `exp_avg_sq`; `step` counts this step (1-based)."""
    fused = torch._fused_adamw_ if rule is UpdateRule.ADAMW else torch._fused_adam_
    step_tensor = torch.tensor(float(step), dtype=torch.float32, device=param.device)
    fused(
        [param], [grad], [exp_avg], [exp_avg_sq], [], [step_tensor],
        lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps,
        amsgrad=False, maximize=hp.maximize, grad_scale=None, found_inf=None,
    )
