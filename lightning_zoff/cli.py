"""LightningCLI with the "zoff" strategy names registered:

    python -m lightning_zoff.cli fit --config conf/cli/gpt_tiny.yaml [--trainer.max_steps=3]

Model and data are chosen by `class_path` (any LightningModule / LightningDataModule), the strategy by its registered
name (`zoff`, `zoff_no_offload`) or as `class_path: lightning_zoff.ZoffStrategy` with `init_args`. The progress bar and
the quiet output are the main job's (`lightning_zoff.examples.progress`, `lightning_zoff.examples.quiet`).
"""

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning_utilities.core.imports import RequirementCache
from typing_extensions import override

import lightning_zoff  # noqa: F401  registers the strategy names before the trainer's arguments are parsed
from lightning_zoff.examples.progress import progress_bar
from lightning_zoff.examples.quiet import QuietRanks, quiet

_CLI_EXTRA = RequirementCache("jsonargparse[signatures]>=4.27.7")  # what LightningCLI itself requires


class ZoffCLI(LightningCLI):
    """LightningCLI whose Trainer also gets `QuietRanks` and the main job's progress bar (unless the configuration
    turns the bar off or gives one)."""

    @override
    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        trainer_config = self._get(self.config_init, "trainer", default={})
        given = kwargs.pop("callbacks", None) or trainer_config.get("callbacks")
        callbacks = [*(given if isinstance(given, list) else [given] if given else []), QuietRanks()]
        enabled = trainer_config.get("enable_progress_bar") is not False
        if enabled and not any(isinstance(callback, ProgressBar) for callback in callbacks):
            callbacks.append(progress_bar())
        return super().instantiate_trainer(callbacks=callbacks, **kwargs)


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    if not _CLI_EXTRA:
        raise SystemExit("python -m lightning_zoff.cli needs LightningCLI's parser: pip install 'lightning-zoff[cli]'"
                         " (or, from a checkout, pip install -e '.[cli]').")
    quiet()  # ranks started by running the command again pass here too
    return ZoffCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                   args=args, run=run)


if __name__ == "__main__":
    main()
