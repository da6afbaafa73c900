"""LoRA fine-tuning with Hugging Face peft: low-rank adapters beside the chosen linear layers of every block, the rest
of the model frozen. Needs `pip install -e '.[lora]'`."""

from __future__ import annotations

from typing import Any

from torch import nn


def add_lora(model: nn.Module, options: dict[str, Any]) -> nn.Module:
    """`model` with peft's LoRA adapters injected in place (`options`: `peft.LoraConfig`'s arguments, such as `r`,
    `lora_alpha`, `target_modules`) and every other parameter frozen.

    In place, not wrapped in a `PeftModel`: the model keeps its class, its forward and its weights' names, so its
    blocks stay the units and a checkpoint of the base model loads into it by name. Adapters start as the identity
    (`lora_B` zero). Build it on the CPU: a model built on the meta device is initialised by the base model's own
    scheme, which would not leave `lora_B` zero."""
    from peft import LoraConfig, inject_adapter_in_model

    model = inject_adapter_in_model(LoraConfig(**options), model)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    return model
