"""What LitGPT's scripts read, made here without a download: a tiny model's checkpoint directory (config, weights, a
word-level tokenizer trained here) and a local JSON instruction set; and `run_litgpt`, which runs a LitGPT script's
`main` as its `setup` launches it with the losses it logs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import litgpt  # .ci/run installs it (pip install --no-deps 'litgpt==0.5.13')
import torch
from lightning.fabric import Fabric
from litgpt.args import TrainArgs
from litgpt.data import JSON

from zoffbench import litgpt_inputs

VOCAB = 128
TINY = dict(n_layer=2, n_embd=32, n_head=4, block_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB)


def config() -> litgpt.Config:
    return litgpt.Config.from_name("pythia-14m", **TINY)


def checkpoint_dir(root: Path, weights: dict[str, torch.Tensor] | None = None) -> Path:
    """What `litgpt download` would leave for the tiny config, made here (`zoffbench.litgpt_inputs`)."""
    return litgpt_inputs.checkpoint_dir(root, config(), weights)


def dataset(root: Path) -> Path:
    return litgpt_inputs.dataset(root)


def instructions(data: str | Path, max_steps: int) -> tuple[JSON, TrainArgs]:
    """The JSON instruction set at `data` and the finetune scripts' loop over it for `max_steps` optimizer steps of 2
    micro-batches of one sample on each of 2 ranks."""
    train = TrainArgs(save_interval=None, log_interval=1, global_batch_size=4, micro_batch_size=1, lr_warmup_steps=1,
                      epochs=1, max_steps=max_steps, max_seq_length=64)
    return JSON(Path(data), val_split_fraction=0.25, num_workers=0), train


def run_litgpt(fabric: Fabric, main: Callable[..., Any], *args: Any, **kwargs: Any) -> list[float]:
    """LitGPT's `main(fabric, *args, **kwargs)` in the launched ranks; the losses it logs, in order (`fabric.log_dict`'s
    "loss": rank 0's mean over the accumulation window; "val_loss": the validation's, averaged over the ranks)."""
    losses: list[float] = []
    fabric.log_dict = lambda metrics, step=None: losses.extend(float(metrics[k]) for k in ("loss", "val_loss")
                                                               if k in metrics)
    main(fabric, *args, **kwargs)
    return losses


def relative_difference(a: list[float], b: list[float]) -> float:
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((x - y).abs() / y.abs()).max())
