"""Which update rule a user's optimizer asks for, and its per-group hyperparameters.

The user's optimizer object stays the one Lightning and the LR schedulers see; zoff only reads its
`param_groups` at every step, so anything that mutates them (schedulers, callbacks) takes effect.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from enum import Enum

import torch

SUPPORTED_OPTIMIZERS = (
    "torch.optim.AdamW", "torch.optim.Adam", "lightning_zoff.optim.AdamW", "lightning_zoff.optim.Adam",
    "lightning_zoff.optim.Lion",
)


class UpdateRule(Enum):
    ADAM = "adam"  # weight decay as L2 added to the gradient
    ADAMW = "adamw"  # decoupled weight decay
    LION = "lion"  # sign of the interpolated momentum, decoupled weight decay


@dataclass(frozen=True)
class GroupHyperparams:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool

    @staticmethod
    def of(group: dict) -> GroupHyperparams:
        beta1, beta2 = (float(b) for b in group["betas"])
        return GroupHyperparams(
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=float(group.get("eps", 0.0)),  # Lion has none
            weight_decay=float(group["weight_decay"]),
            maximize=bool(group.get("maximize", False)),
        )


def update_rule_for(optimizer: torch.optim.Optimizer) -> UpdateRule:
    """The update rule for `optimizer`, or a TypeError that says what zoff supports."""
    rule = getattr(optimizer, "rule", None)  # lightning_zoff.optim classes say which rule they are
    if isinstance(rule, UpdateRule):
        return rule
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        raise TypeError(
            f"strategy='zoff' runs the optimizer step on the CPU and supports {', '.join(SUPPORTED_OPTIMIZERS)};"
            f" configure_optimizers returned {name}. Return one of the supported optimizers instead."
        )
    for group in optimizer.param_groups:
        if group.get("amsgrad", False):
            raise ValueError("strategy='zoff' does not support amsgrad=True; set amsgrad=False.")
    # torch >= 2.6 implements AdamW as Adam(decoupled_weight_decay=True); older torch has separate classes.
    decoupled = {bool(g.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
                 for g in optimizer.param_groups}
    if len(decoupled) != 1:
        raise ValueError("strategy='zoff' needs one weight-decay mode for all param groups of the optimizer.")
    return UpdateRule.ADAMW if decoupled.pop() else UpdateRule.ADAM


def warn_if_bf16_moments_cannot_decay(rule: UpdateRule, optimizer: torch.optim.Optimizer) -> None:
    # Rounding to nearest gives a bf16 moment back unchanged unless the step moves it by half a bf16 ulp, 2^-9 to 2^-8
    # of its value. Decaying, a step moves it by at most (1 - beta) of its value: with 1 - beta below 2^-8 the decay
    # can round away, below 2^-9 (beta2 = 0.999) it always does, and the moment only ever grows.
    decays = ([("beta2", 1, "exp_avg")] if rule is UpdateRule.LION
              else [("beta1", 0, "exp_avg"), ("beta2", 1, "exp_avg_sq")])
    slow = sorted({f"{name}={float(group['betas'][i]):g} ({moment})" for group in optimizer.param_groups
                   for name, i, moment in decays if 1 - float(group["betas"][i]) < 2**-8})
    if slow:
        warnings.warn(
            f"zoff: optimizer_state_dtype='bf16' with {', '.join(slow)}: a step decays such a moment by less than half"
            " a bf16 ulp, so rounding to nearest can keep its old value (at 0.999 it never shrinks, it only grows)."
            " Use betas of at most 0.996 (0.95 is common for beta2) or optimizer_state_dtype='fp32'.",
            stacklevel=3,
        )
