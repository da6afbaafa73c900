"""ZoffPrecision: what every `precision=` flag becomes under strategy="zoff".

The parameters on the accelerator are shards in the compute dtype (bf16 in 16-bit modes); the fp32 master lives
with the optimizer state in the engine. So this plugin only chooses that dtype and the autocast context, and
records the clipping request that the engine applies with the global gradient norm.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.fabric.utilities.apply_func import apply_to_collection

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed"}


class ZoffPrecision(Precision):
    """Precision plugin of `ZoffStrategy`.

    Args:
        precision: ``"32-true"`` (fp32 shards and gradients), ``"bf16-mixed"`` (bf16 shards, autocast to bf16) or
            ``"bf16-true"`` (bf16 shards, bf16 inputs, no autocast).
    """

    def __init__(self, precision: str | int = "bf16-mixed") -> None:
        precision = _ALIASES.get(precision, precision)
        if precision in ("16-mixed", "16-true"):
            raise ValueError(
                f"precision={precision!r} (fp16 with loss scaling) is not supported by zoff yet."
                f" Use one of {SUPPORTED_PRECISION}; bf16-mixed needs no loss scaling."
            )
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"zoff does not support precision={precision!r}. Choose one of {SUPPORTED_PRECISION}"
                " (the optimizer always keeps an fp32 master copy on the host)."
            )
        self.precision = precision
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.clip_norm_request: float | None = None

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.float32 if self.precision == "32-true" else torch.bfloat16

    def forward_context(self) -> AbstractContextManager:
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return nullcontext()

    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)

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
