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

__all__ = ["ZoffFabricPrecision", "ZoffFabricStrategy", "ZoffPrecision", "ZoffStatsMonitor", "ZoffStrategy"]
__version__ = "0.1.0"

_DOORS = {"ZoffPrecision": "lightning_zoff.trainer", "ZoffStrategy": "lightning_zoff.trainer",
          "ZoffStatsMonitor": "lightning_zoff.trainer",
          "ZoffFabricPrecision": "lightning_zoff.fabric", "ZoffFabricStrategy": "lightning_zoff.fabric"}


def __getattr__(name: str) -> Any:
    if name in _DOORS:
        return getattr(importlib.import_module(_DOORS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register_with_lightning()


class _UnlessConfigured(logging.StreamHandler):
    """zoff's lines on stderr while the application has configured no logging, as Lightning's own logger prints its
    own; once it has (`logging.basicConfig`, Hydra, `dictConfig`), the root's handlers print them and this one stays
    silent, so each line appears once. Lightning decides when it is imported; Hydra configures logging later, so this
    decides at each line."""

    def emit(self, record: logging.LogRecord) -> None:
        if (_log.propagate and logging.getLogger().handlers) or len(_log.handlers) > 1:
            return  # the application's handlers have it
        super().emit(record)


_log = logging.getLogger(__name__)
if not _log.handlers:
    _log.addHandler(_UnlessConfigured())
    _log.setLevel(logging.INFO)
