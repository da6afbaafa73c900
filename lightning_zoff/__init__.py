"""lightning_zoff: ZeRO-3 training for PyTorch Lightning with the optimizer offloaded to the CPU.

Importing the package registers ``"zoff"`` and ``"zoff_no_offload"`` in Lightning's StrategyRegistry, so
``Trainer(strategy="zoff")`` works after ``import lightning_zoff``.
"""

import logging

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zoff.precision import ZoffPrecision
from lightning_zoff.strategy import ZoffStrategy

__all__ = ["ZoffPrecision", "ZoffStrategy"]
__version__ = "0.1.0"

if "zoff" not in StrategyRegistry:
    ZoffStrategy.register_strategies(StrategyRegistry)

_log = logging.getLogger(__name__)
if not _log.handlers:  # like Lightning's own logger: INFO to stderr unless the application configured logging
    _log.addHandler(logging.StreamHandler())
    _log.setLevel(logging.INFO)
