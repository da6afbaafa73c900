"""ZoffPrecision: what every `precision=` flag becomes under `Trainer(strategy="zoff")`.

The parameters on the accelerator are shards in the compute dtype (bf16 in 16-bit modes); the fp32 master lives
with the optimizer state in the engine. So this plugin only chooses that dtype and the autocast context, and
records the clipping request that the engine applies with the global gradient norm (`PrecisionMath`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from typing_extensions import override

from lightning_zoff.precision_math import PrecisionMath


class ZoffPrecision(PrecisionMath, Precision):
    """Precision plugin of `ZoffStrategy`.

    Args:
        precision: ``"32-true"`` (fp32 shards and gradients), ``"bf16-mixed"`` / ``"16-mixed"`` (16-bit shards,
            autocast to that dtype) or ``"bf16-true"`` / ``"16-true"`` (16-bit shards and inputs, no autocast).
        loss_scale: fp16 only, options of the dynamic loss scale (`DynamicLossScaler`: ``scale`` (initial,
            2**16), ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``hysteresis``, ``min_scale``).
    """

    def __init__(self, precision: str | int = "bf16-mixed", **loss_scale: Any) -> None:
        PrecisionMath.__init__(self, precision, **loss_scale)

    @override
    def forward_context(self) -> AbstractContextManager:
        return self.autocast()

    @override
    def convert_input(self, data: Any) -> Any:
        return self.cast_input(data)

    @override
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        return self.scale_loss(super().pre_backward(tensor, module))


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
        self.request_clip(clip_val)
