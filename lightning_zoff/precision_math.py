"""What a precision flag means to zoff, for either front door: the dtype of the accelerator's shards, the forward's
autocast, the cast of the inputs, fp16's dynamic loss scale (`DynamicLossScaler`) and the clipping request that the
engine applies. The doors' precision plugins (`trainer/precision.py`, `fabric/precision.py`) are glue over this.

The fp32 master lives with the optimizer state in the engine, so no precision here ever converts a module: the
accelerator's shards are cast while sharding (`sharding.shard_model`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightning_zoff._compat import apply_to_tensors

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed"}


class PrecisionMath:
    """The settings behind a precision flag. Each front door's precision plugin is one (`trainer.ZoffPrecision`,
    `fabric.ZoffFabricPrecision`, with this class first among their bases: its `state_dict` is theirs);
    `loss_scale` are the fp16 loss-scale options of `DynamicLossScaler`."""

    def __init__(self, precision: str | int = "bf16-mixed", **loss_scale: Any) -> None:
        precision = _ALIASES.get(precision, precision)
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"zoff does not support precision={precision!r}. Choose one of {SUPPORTED_PRECISION}"
                " (the optimizer always keeps an fp32 master copy on the host)."
            )
        if loss_scale and not str(precision).startswith("16"):
            raise ValueError(f"loss-scale options {sorted(loss_scale)} apply to fp16 only, not {precision!r}.")
        self.precision: Any = precision  # one of SUPPORTED_PRECISION, checked above
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"  # the strategy sets its own at setup
        self.clip_norm_request: float | None = None
        self.scaler = DynamicLossScaler(**loss_scale) if self.precision.startswith("16") else None

    @property
    def param_dtype(self) -> torch.dtype:
        return {"32": torch.float32, "bf16": torch.bfloat16, "16": torch.float16}[self.precision.split("-")[0]]

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def autocast(self) -> AbstractContextManager:
        if self.precision.endswith("-mixed"):
            return torch.autocast(self.device_type, dtype=self.param_dtype)
        return nullcontext()

    def cast_input(self, data: Any) -> Any:
        """`-true` 16-bit: floating-point inputs in the shards' dtype (the model has no fp32 weights to meet)."""
        if not self.precision.endswith("-true") or self.param_dtype == torch.float32:
            return data
        dtype = self.param_dtype
        return apply_to_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, data)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # the engine divides by the same scale inside the kernel's combined scale
        return loss * self.scaler.scale if self.scaler is not None else loss

    def state_dict(self) -> dict[str, Any]:
        """The loss scale's state (fp16), for checkpoints."""
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])

    def request_clip(self, max_norm: float) -> None:
        """Record the request; the engine clips with the norm of the whole (global, accumulated) gradient."""
        if max_norm > 0:
            self.clip_norm_request = float(max_norm)

    def take_clip_request(self) -> float | None:
        request, self.clip_norm_request = self.clip_norm_request, None
        return request


@dataclass
class DynamicLossScaler:
    """fp16's dynamic loss scale: the loss is scaled up so small gradients survive fp16. On overflow the step is
    skipped; after `hysteresis` overflows in a row the scale is multiplied by `backoff_factor` (not below
    `min_scale`). After `growth_interval` good steps in a row it grows by `growth_factor`."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    good_steps: int = 0
    overflows_left: int = -1  # overflows still tolerated before backing off; -1: not started

    def __post_init__(self) -> None:
        if not (self.growth_factor > 1 and 0 < self.backoff_factor < 1 and self.growth_interval > 0
                and self.hysteresis >= 1 and 0 < self.min_scale <= self.scale):
            raise ValueError(
                "DynamicLossScaler needs growth_factor > 1, 0 < backoff_factor < 1, growth_interval > 0,"
                f" hysteresis >= 1 and 0 < min_scale <= scale; got {asdict(self)}"
            )
        if self.overflows_left < 0:
            self.overflows_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            self.good_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self.overflows_left = self.hysteresis
            return
        self.good_steps += 1
        self.overflows_left = self.hysteresis
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
