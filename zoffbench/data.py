"""The data every run of scripts/bench/bench.py trains on: random token ids of the model's vocabulary, `batch` x `seq`
a batch, through a `torch.utils.data.DataLoader` with `num_workers` loader processes, as a user's job feeds a real
model (0: drawn in the training process)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override


class RandomTokenWindows(Dataset):
    """Item i: `seq` + 1 token ids drawn from a generator seeded by (seed, i), split into (input, next tokens). Drawn
    when asked, so each worker makes its own items and nothing is held for the whole run."""

    def __init__(self, vocab_size: int, seq: int, length: int, seed: int = 0) -> None:
        self.vocab_size, self.seq, self.length, self.seed = vocab_size, seq, length, seed

    def __len__(self) -> int:
        return self.length

    @override
    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        tokens = torch.randint(self.vocab_size, (self.seq + 1,), generator=generator)
        return tokens[:-1], tokens[1:]


class RandomTokens(pl.LightningDataModule):
    """`length` windows of random tokens in batches of `batch`; Lightning gives each rank its share."""

    def __init__(self, vocab_size: int, seq: int, batch: int, length: int, num_workers: int = 0) -> None:
        super().__init__()
        self.vocab_size, self.seq, self.batch, self.length = vocab_size, seq, batch, length
        self.num_workers = num_workers

    @override
    def train_dataloader(self) -> DataLoader:
        workers: dict[str, Any] = {}
        if self.num_workers > 0:  # kept for the whole fit: a worker's start is not part of a measured step
            workers = dict(num_workers=self.num_workers, persistent_workers=True, prefetch_factor=2)
        return DataLoader(RandomTokenWindows(self.vocab_size, self.seq, self.length), batch_size=self.batch,
                          shuffle=False, drop_last=True, **workers)


class TextTokens(pl.LightningDataModule):
    """The main job's corpus (the standard library's source, byte tokens) in windows of `seq` in batches of `batch`,
    shuffled: training on text whose loss falls, so the gradient's norm is that of a real run past its warm-up."""

    def __init__(self, seq: int, batch: int, num_workers: int = 0) -> None:
        super().__init__()
        from lightning_zoff.examples.corpus import CorpusDataModule

        self.corpus = CorpusDataModule(block_size=seq, batch_size=batch, num_workers=num_workers)

    @override
    def setup(self, stage: str) -> None:
        self.corpus.setup(stage)

    @override
    def train_dataloader(self) -> DataLoader:
        return self.corpus.train_dataloader()
