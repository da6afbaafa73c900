"""Two forked ranks that both have the same thing to say: the memory report and a warning (bf16 moments with Adam's
default beta2 = 0.999). zoff's debug lines on (argv[1] == "debug"): each rank's own CPU layout."""

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

import lightning.pytorch as pl

from lightning_zoff import ZoffStrategy
from tiny import TinyModule, token_loader

if __name__ == "__main__":
    if sys.argv[1:] == ["debug"]:
        logging.getLogger("lightning_zoff").setLevel(logging.DEBUG)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         strategy=ZoffStrategy(start_method="fork", optimizer_state_dtype="bf16"))
    trainer.fit(TinyModule("adam"), token_loader(n=16))
