"""fit -> validate -> test -> predict in one process per rank, with Lightning's default subprocess launcher."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

import lightning.pytorch as pl

import lightning_zoff  # noqa: F401  (registers "zoff")
from helpers.tiny import token_loader
from helpers.tiny_module import TinyModule


class Predicting(TinyModule):
    def predict_step(self, batch, batch_idx):
        return self.model(batch[0]).argmax(-1)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    pl.seed_everything(3)
    module = Predicting()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="zoff", precision="bf16-mixed", max_steps=8,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module, token_loader(n=64), val_dataloaders=token_loader(n=16, seed=1))
    val = trainer.validate(module, token_loader(n=16, seed=1))[0]["val_loss"]
    test = trainer.test(module, token_loader(n=16, seed=1))[0]["test_loss"]
    preds = trainer.predict(module, token_loader(n=16, seed=1))
    # fitting again: the same sharded weights, a fresh optimizer from configure_optimizers (as under DDP)
    trainer.fit_loop.epoch_loop.max_steps = 12
    trainer.fit(module, token_loader(n=64))
    result = {"val": val, "test": test, "n_preds": sum(len(p) for p in preds), "global_step": trainer.global_step,
              "losses": module.losses, "sampler": type(trainer.train_dataloader.sampler).__name__}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
