"""Which update rule a user's optimizer asks for, and its per-group hyperparameters.

The user's optimizer object stays the one Lightning and the LR schedulers see; zoff only reads its
`param_groups` at every step, so anything that mutates them (schedulers, callbacks) takes effect.
"""

from __future__ import annotations

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
