"""LightningCLI with the "zoff" strategy names registered:

    python -m lightning_zoff.cli fit --config conf/cli/gpt_tiny.yaml [--trainer.max_steps=3]

Model and data are chosen by `class_path` (any LightningModule / LightningDataModule), the strategy by its registered
name (`zoff`, `zoff_no_offload`) or as `class_path: lightning_zoff.ZoffStrategy` with `init_args`.
"""

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI
from lightning_utilities.core.imports import RequirementCache

import lightning_zoff  # noqa: F401  registers the strategy names before the trainer's arguments are parsed

_CLI_EXTRA = RequirementCache("jsonargparse[signatures]>=4.27.7")  # what LightningCLI itself requires


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    if not _CLI_EXTRA:
        raise SystemExit("python -m lightning_zoff.cli needs LightningCLI's parser: pip install 'lightning-zoff[cli]'"
                         " (or, from a checkout, pip install -e '.[cli]').")
    return LightningCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                        args=args, run=run)


if __name__ == "__main__":
    main()
