"""Training data that needs no download: the Python standard library's own source, as bytes.

Everything here is deterministic (sorted file order, fixed window offsets, seeded generators) so a
DistributedSampler splits it the same way on every rank and a DDP reference run sees identical batches.
"""

import os
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_zoff.app.resumable import ResumableLoader


def stdlib_bytes(max_bytes: int = 8_000_000) -> bytes:
    """The first `max_bytes` of the standard library's .py files, concatenated in sorted path order."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        # site-packages lives under the stdlib directory but is not the stdlib (and is large)
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        paths += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    paths.sort()
    chunks, total = [], 0
    for path in paths:
        if total >= max_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
    return b"".join(chunks)[:max_bytes]


class DataValueError(ValueError):
    """An argument of a data module that leaves the data empty or invalid; `name` is the argument's."""

    def __init__(self, name: str, value: object, reason: str) -> None:
        super().__init__(f"{name}={value}: {reason}")
        self.name = name


def _positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataValueError(name, value, "expected a positive integer")


class ByteWindows(Dataset):
    """Non-overlapping windows of a token stream: item i is (x, y), y being x shifted by one token."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        assert tokens.dim() == 1, "need a 1-D stream longer than one block"
        assert len(tokens) > block_size, "need a 1-D stream longer than one block"
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        # every window needs one extra token for its last target
        return (len(self.tokens) - 1) // self.block_size

    @override
    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class _WindowsDataModule(pl.LightningDataModule):
    """Dataloaders over train/val/test ByteWindows that subclasses build in `setup`."""

    train_set: ByteWindows
    val_set: ByteWindows
    test_set: ByteWindows

    def __init__(self, batch_size: int, num_workers: int, seed: int):
        super().__init__()
        _positive(batch_size=batch_size)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise DataValueError("num_workers", num_workers, "expected 0 (load in the training process) or more")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed

    def _loader(self, dataset: Dataset, shuffle: bool = False) -> DataLoader:
        # seeded, so an undistributed run shuffles the same way every time (Lightning swaps in a
        # DistributedSampler, seeded by seed_everything, when the strategy is distributed); the shuffled (training)
        # loader continues mid-epoch when a run resumes
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return (ResumableLoader if shuffle else DataLoader)(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=generator,
            num_workers=self.num_workers,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set)

    @override
    def predict_dataloader(self) -> DataLoader:
        # Lightning does not pad the predict split across ranks; uneven batch counts would leave a
        # sharded model's ranks waiting on each other's collectives, so trim to a multiple of the world.
        world_size = self.trainer.world_size if self.trainer is not None else 1
        usable = len(self.val_set) // world_size * world_size
        return self._loader(torch.utils.data.Subset(self.val_set, range(usable)))


class CorpusDataModule(_WindowsDataModule):
    """Byte-level stdlib source: train on the start, validate and test on the two slices at the end."""

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 8,
        max_bytes: int = 8_000_000,
        val_fraction: float = 0.01,
        num_workers: int = 0,
        seed: int = 1234,
    ):
        super().__init__(batch_size, num_workers, seed)
        _positive(block_size=block_size, max_bytes=max_bytes)
        if not 0 < val_fraction < 0.5:
            raise DataValueError("val_fraction", val_fraction, "expected a fraction above 0 and below 0.5 (the"
                                 " validation and the test slices take it each; training the rest)")
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.vocab_size = 256

    @override
    def setup(self, stage: str | None = None) -> None:
        tokens = torch.frombuffer(bytearray(stdlib_bytes(self.max_bytes)), dtype=torch.uint8)
        n_val = max(int(len(tokens) * self.val_fraction), self.block_size + 1)
        if len(tokens) - 2 * n_val <= self.block_size:
            raise DataValueError("max_bytes", self.max_bytes, f"{len(tokens)} bytes of source leave no training"
                                 f" window of block_size={self.block_size} beside validation and test ({n_val} each)")
        self.train_set = ByteWindows(tokens[: -2 * n_val], self.block_size)
        self.val_set = ByteWindows(tokens[-2 * n_val : -n_val], self.block_size)
        self.test_set = ByteWindows(tokens[-n_val:], self.block_size)


class SyntheticDataModule(_WindowsDataModule):
    """Uniformly random tokens from a fixed seed: no I/O at all, for throughput runs and tests.

    Nothing is learnable, so the loss stays near ln(vocab_size).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        batch_size: int = 8,
        num_samples: int = 16384,
        num_workers: int = 0,
        seed: int = 1234,
    ):
        super().__init__(batch_size, num_workers, seed)
        _positive(vocab_size=vocab_size, block_size=block_size, num_samples=num_samples)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.num_samples = num_samples

    def _windows(self, num_windows: int, seed: int) -> ByteWindows:
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(self.vocab_size, (num_windows * self.block_size + 1,), generator=generator)
        return ByteWindows(tokens, self.block_size)

    @override
    def setup(self, stage: str | None = None) -> None:
        n_eval = max(self.num_samples // 100, 1)
        self.train_set = self._windows(self.num_samples, self.seed)
        self.val_set = self._windows(n_eval, self.seed + 1)
        self.test_set = self._windows(n_eval, self.seed + 2)
