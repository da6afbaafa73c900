"""What the main job (scripts/train.py) and the CLI (lightning_zoff.cli) leave out of their output, in one place:
lines that say nothing about the run and ask nothing of the user.

- Lightning's advertisements, logged at every fit: "💡 Tip: For seamless cloud logging ... litlogger" and "... cloud
  uploads ... litmodels".
- Third-party deprecation warnings that only a new release of the library can act on: Lightning 2.6 asks torch >= 2.13's
  pytree the old way every fit ("`isinstance(treespec, LeafSpec)` is deprecated").

`quiet()` filters them in this process; ranks forked from it inherit the filters. `QuietRanks`, a callback, filters
them again in every rank at setup, for ranks that start afresh (spawned, or the command run again per rank).
"""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
from typing_extensions import override

TIP = "💡 Tip:"
DEPRECATIONS = (r"`isinstance\(treespec, LeafSpec\)` is deprecated",)  # regular expressions of the messages


class WithoutTips(logging.Filter):
    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TIP)


_WITHOUT_TIPS = WithoutTips()  # one instance: addFilter adds it once however often quiet() runs


def quiet() -> None:
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_WITHOUT_TIPS)
    for message in DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message)


class QuietRanks(pl.Callback):
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        quiet()
