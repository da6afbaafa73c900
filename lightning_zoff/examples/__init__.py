"""Example model and data used by scripts/train.py and the tests."""

from lightning_zoff.examples.corpus import ByteWindows, CorpusDataModule, SyntheticDataModule
from lightning_zoff.examples.gpt import GPT, GPTConfig, GPTModule

__all__ = ["GPT", "ByteWindows", "CorpusDataModule", "GPTConfig", "GPTModule", "SyntheticDataModule"]
