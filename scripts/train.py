"""Train the example GPT with Hydra configs from conf/.

    python scripts/train.py                                   # zoff, GPU if there is one, else 2 CPU ranks
    python scripts/train.py strategy=ddp trainer.max_steps=3  # the reference strategy, a quick check
    python scripts/train.py data=synthetic model.n_layer=8

Writes into the Hydra run dir (outputs/<date>/<time>/): final.ckpt, loss.png and Lightning's logs.
"""

import sys
from pathlib import Path

# Run from a checkout without installing the package; resolved from this file, so any cwd works.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from matplotlib.figure import Figure
from omegaconf import DictConfig, OmegaConf

import lightning_zoff  # noqa: F401  registers the "zoff" strategy names with Lightning


class LossHistory(pl.Callback):
    """Rank 0's training loss every step and the (all-reduced) validation loss after each validation."""

    def __init__(self):
        self.train: list[tuple[int, torch.Tensor]] = []
        self.val: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            # kept as a tensor: .item() here would synchronize with the GPU every step
            self.train.append((trainer.global_step, outputs["loss"].detach()))

    def on_validation_end(self, trainer, pl_module):
        if trainer.is_global_zero and not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            self.val.append((trainer.global_step, trainer.callback_metrics["val_loss"].item()))

    def plot(self, path: Path) -> None:
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        if self.train:
            steps, losses = zip(*self.train)
            ax.plot(steps, torch.stack(losses).float().cpu(), label="train (rank 0)", linewidth=0.8)
        if self.val:
            ax.plot(*zip(*self.val), "o-", label="val")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross entropy (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.savefig(path, dpi=120, bbox_inches="tight")


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    # version_base 1.3 leaves the cwd alone; every output goes under the run dir, named absolutely
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    pl.seed_everything(cfg.seed, workers=True)

    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model, **OmegaConf.to_container(cfg.optimizer))
    strategy = instantiate(cfg.strategy)
    history = LossHistory()
    trainer = pl.Trainer(
        strategy=strategy,
        callbacks=[history],
        default_root_dir=run_dir,
        **OmegaConf.to_container(cfg.trainer),
    )
    trainer.fit(model, datamodule=datamodule)

    # a collective: every rank writes its part
    trainer.save_checkpoint(run_dir / "final.ckpt")

    # Every rank joins generation since a sharded forward all-gathers; the same seed makes all ranks
    # draw the same tokens, so they agree on the text too.
    torch.manual_seed(cfg.seed)
    model.eval()
    text = model.sample(
        cfg.sample.prompt.encode(),
        cfg.sample.max_new_tokens,
        temperature=cfg.sample.temperature,
        top_k=cfg.sample.top_k,
    )

    if trainer.is_global_zero:
        history.plot(run_dir / "loss.png")
        print(f"checkpoint: {run_dir / 'final.ckpt'}\nloss curve: {run_dir / 'loss.png'}")
        print("-" * 40 + " sample " + "-" * 40)
        print(text.decode("utf-8", errors="replace"))


if __name__ == "__main__":
    # Hydra's defaults cannot depend on the machine, so the GPU trainer is chosen here, before Hydra
    # reads the command line; a trainer= given by the user wins.
    if torch.cuda.is_available() and not any(a.startswith(("trainer=", "+trainer=")) for a in sys.argv[1:]):
        sys.argv.append("trainer=gpu")
    main()
