"""ZoffPrecision: what every `precision=` flag becomes under strategy="zoff".

The parameters on the accelerator are shards in the compute dtype (bf16 in 16-bit modes); the fp32 master lives
with the optimizer state in the engine. So this plugin only chooses that dtype and the autocast context, and
records the clipping request that the engine applies with the global gradient norm.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
from lightning.fabric.connector import _PRECISION_INPUT_STR
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from typing_extensions import override

from lightning_zoff.loss_scale import DynamicLossScaler

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed"}


class ZoffPrecision(Precision):
    """Precision plugin of `ZoffStrategy`.

    Args:
        precision: ``"32-true"`` (fp32 shards and gradients), ``"bf16-mixed"`` / ``"16-mixed"`` (16-bit shards,
            autocast to that dtype) or ``"bf16-true"`` / ``"16-true"`` (16-bit shards and inputs, no autocast).
        loss_scale: fp16 only, options of the dynamic loss scale (`DynamicLossScaler`: ``scale`` (initial,
            2**16), ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``hysteresis``, ``min_scale``).
    """

    def __init__(self, precision: str | int = "bf16-mixed", **loss_scale: Any) -> None:
        precision = _ALIASES.get(precision, precision)
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"zoff does not support precision={precision!r}. Choose one of {SUPPORTED_PRECISION}"
                " (the optimizer always keeps an fp32 master copy on the host)."
            )
        if loss_scale and not precision.startswith("16"):
            raise ValueError(f"loss-scale options {sorted(loss_scale)} apply to fp16 only, not {precision!r}.")
        self.precision = cast(_PRECISION_INPUT_STR, precision)  # one of SUPPORTED_PRECISION, checked above
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.clip_norm_request: float | None = None
        self.scaler = DynamicLossScaler(**loss_scale) if precision.startswith("16") else None

    @property
    def param_dtype(self) -> torch.dtype:
        return {"32": torch.float32, "bf16": torch.bfloat16, "16": torch.float16}[self.precision.split("-")[0]]

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @override
    def forward_context(self) -> AbstractContextManager:
        if self.precision.endswith("-mixed"):
            return torch.autocast(self.device_type, dtype=self.param_dtype)
        return nullcontext()

    @override
    def convert_input(self, data: Any) -> Any:
        if not self.precision.endswith("-true") or self.param_dtype == torch.float32:
            return data
        dtype = self.param_dtype
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    @override
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        tensor = super().pre_backward(tensor, module)
        # the engine divides by the same scale inside the kernel's combined scale
        return tensor * self.scaler.scale if self.scaler is not None else tensor

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])

    @override
    def clip_gradients(
        self,
        optimizer: Optimizable,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Record the request; the engine clips with the norm of the whole (global, accumulated) gradient."""
        if clip_val <= 0:
            return
        if gradient_clip_algorithm != GradClipAlgorithmType.NORM:
            raise ValueError(
                "zoff clips gradients by norm only; set gradient_clip_algorithm='norm' (the default)."
            )
        self.clip_norm_request = float(clip_val)

    def take_clip_request(self) -> float | None:
        request, self.clip_norm_request = self.clip_norm_request, None
        return request
