"""Fits a module zoff refuses with the default launcher (Lightning re-runs this script for rank 1): `manual` (manual
optimization) or `sgd` (an optimizer zoff cannot run)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

import lightning.pytorch as pl

from lightning_zoff import ZoffStrategy
from tiny import TinyModule, token_loader


class Refused(TinyModule):
    def __init__(self, mistake: str) -> None:
        super().__init__("sgd" if mistake == "sgd" else "adamw")
        self.automatic_optimization = mistake != "manual"


if __name__ == "__main__":
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZoffStrategy(), max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Refused(sys.argv[1]), token_loader(n=16))
