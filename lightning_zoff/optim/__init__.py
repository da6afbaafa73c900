"""Optimizers the zoff engine runs on the CPU."""

from lightning_zoff.optim.rules import SUPPORTED_OPTIMIZERS, GroupHyperparams, UpdateRule, update_rule_for

__all__ = ["SUPPORTED_OPTIMIZERS", "GroupHyperparams", "UpdateRule", "update_rule_for"]
