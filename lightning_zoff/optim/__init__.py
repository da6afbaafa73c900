"""Optimizers the zoff engine runs on the CPU: fused-kernel AdamW, Adam and Lion, and the mapping of torch's."""

from lightning_zoff.optim.fused_cpu import Adam, AdamW, Lion
from lightning_zoff.optim.rules import SUPPORTED_OPTIMIZERS, GroupHyperparams, UpdateRule, update_rule_for

__all__ = ["SUPPORTED_OPTIMIZERS", "Adam", "AdamW", "GroupHyperparams", "Lion", "UpdateRule", "update_rule_for"]
