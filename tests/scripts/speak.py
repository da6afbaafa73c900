"""Two forked ranks that both have the same things to say: the memory report, zoff's warning (bf16 moments with Adam's
default beta2 = 0.999) and another Python warning. zoff's debug lines on (argv[1] == "debug"): each rank's own CPU
layout."""

import logging
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

import lightning.pytorch as pl

from helpers.tiny import token_loader
from helpers.tiny_module import TinyModule
from lightning_zoff import ZoffStrategy


class WarnInEveryRank(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        warnings.warn("a warning that every rank of the node raises alike", stacklevel=1)


if __name__ == "__main__":
    if sys.argv[1:] == ["debug"]:
        logging.getLogger("lightning_zoff").setLevel(logging.DEBUG)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[WarnInEveryRank()],
                         strategy=ZoffStrategy(start_method="fork", optimizer_state_dtype="bf16"))
    trainer.fit(TinyModule("adam"), token_loader(n=16))
