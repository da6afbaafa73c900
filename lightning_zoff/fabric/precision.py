"""ZoffFabricPrecision: what every `precision=` flag becomes under `Fabric(strategy="zoff")`; the settings are the
Trainer's (`PrecisionMath`), this is Fabric's glue."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from typing_extensions import override

from lightning_zoff._compat import apply_to_tensors
from lightning_zoff.precision_math import PrecisionMath


class ZoffFabricPrecision(PrecisionMath, Precision):
    """Precision plugin of `ZoffFabricStrategy`: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"16-mixed"`` or
    ``"16-true"``, and for fp16 the options of the dynamic loss scale (`DynamicLossScaler`), as `ZoffPrecision` takes
    them: ``Fabric(strategy="zoff", plugins=[ZoffFabricPrecision("16-mixed", scale=2**14)])``."""

    def __init__(self, precision: str | int = "bf16-mixed", **loss_scale: Any) -> None:
        PrecisionMath.__init__(self, precision, **loss_scale)
        # set by the strategy: its timing of the forward, which Fabric runs inside `forward_context`
        self.around_forward: Callable[[], AbstractContextManager] = nullcontext

    @override
    def forward_context(self) -> AbstractContextManager:
        stack = ExitStack()
        stack.enter_context(self.around_forward())
        stack.enter_context(self.autocast())
        return stack

    @override
    def convert_input(self, data: Any) -> Any:
        return self.cast_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        # as Fabric's own 16-bit plugins do: the loss is computed in the default dtype
        if self.param_dtype == torch.float32:
            return data
        dtype = torch.get_default_dtype()
        return apply_to_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, data)
