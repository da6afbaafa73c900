"""What zoff refuses whichever door it came in by, before anything is sharded or allocated: the optimizer (one, of a
class the engine has an update for) and a gradient-sum dtype the model's precision cannot accumulate in. The options
themselves are checked by `ZoffConfig`; each door adds its own (`trainer/checks.py`)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zoff.config import ACCUM_DTYPES
from lightning_zoff.optim.rules import update_rule_for

ONE_OPTIMIZER = (
    "strategy='zoff' drives exactly one optimizer; {} {}. Put all parameters in one optimizer, using param groups for"
    " different settings."
)


def check_optimizers(optimizers: list[Any], given_by: str = "configure_optimizers returned") -> None:
    """Refuse what the engine cannot step: other than one optimizer, or one of a class zoff has no update for."""
    if len(optimizers) != 1:
        raise ValueError(ONE_OPTIMIZER.format(given_by, len(optimizers)))
    update_rule_for(optimizers[0])


def check_accum_dtype(grad_accum_dtype: str, precision: str, param_dtype: torch.dtype) -> None:
    # The window's gradient sum lives on the host in fp32, or in the model's own 16-bit dtype (half the bytes,
    # rounded at every micro-batch); another dtype would round differently from both.
    valid = sorted({"fp32"} | {name for name, dtype in ACCUM_DTYPES.items() if dtype == param_dtype})
    if grad_accum_dtype not in valid:
        raise ValueError(
            f"grad_accum_dtype={grad_accum_dtype!r} cannot accumulate gradients of a {precision} model; choose one"
            f" of {valid}."
        )
