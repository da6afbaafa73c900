"""lightning_zoff: ZeRO-3 training for PyTorch Lightning with the optimizer offloaded to the CPU.

Two front doors over one core: `Trainer(strategy="zoff")` (`lightning_zoff.trainer`) and `Fabric(strategy="zoff")`
(`lightning_zoff.fabric`). Importing the package registers ``"zoff"`` and ``"zoff_no_offload"`` in both of Lightning's
strategy registries (`registration`). The core (`offload/`, `sharding`, `training`, `checkpoint/`, the kernels) does
not import Lightning, so the doors' classes load on first use.
"""

import importlib
import logging
from typing import Any

from lightning_zoff.registration import register_with_lightning

__all__ = ["ZoffFabricPrecision", "ZoffFabricStrategy", "ZoffPrecision", "ZoffStrategy"]
__version__ = "0.1.0"

_DOORS = {"ZoffPrecision": "lightning_zoff.trainer", "ZoffStrategy": "lightning_zoff.trainer",
          "ZoffFabricPrecision": "lightning_zoff.fabric", "ZoffFabricStrategy": "lightning_zoff.fabric"}


def __getattr__(name: str) -> Any:
    if name in _DOORS:
        return getattr(importlib.import_module(_DOORS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register_with_lightning()

_log = logging.getLogger(__name__)
if not _log.handlers:  # like Lightning's own logger: INFO to stderr unless the application configured logging
    _log.addHandler(logging.StreamHandler())
    _log.setLevel(logging.INFO)
