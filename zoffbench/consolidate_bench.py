"""Peak host memory of `python -m lightning_zoff.consolidate` against the size of the model it writes.

Trains one step of a model with >= 1 GB of fp32 weights under strategy="zoff" on the CPU, saves a sharded
checkpoint, then consolidates it in a fresh child process that reports its own peak RSS (getrusage). A child that
only imports lightning_zoff gives the interpreter's share of that peak. This process imports no torch and runs
every step as a child: Linux keeps a process's peak RSS across exec, so a child of a big parent would report the
parent's.

    python scripts/bench/bench_consolidate.py [--width 4096] [--blocks 16] [--ranks 1] [--buffer-mb 256] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
from pathlib import Path

from zoffbench.harness import run_function


def build(work: str, width: int, blocks: int, ranks: int) -> None:
    """Train one step and save the sharded checkpoint `work/ck/step1.ckpt` (in a child)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # forked ranks hang if the parent started a larger OpenMP pool
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zoff import ZoffStrategy

    class Wide(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

        def training_step(self, batch, batch_idx):
            x = batch[0]
            for block in self.blocks:
                x = torch.tanh(block(x))
            return x.float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    trainer = pl.Trainer(
        accelerator="cpu", devices=ranks, strategy=ZoffStrategy(start_method="fork"), precision="bf16-true",
        max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=Path(work) / "ck", filename="step1", every_n_train_steps=1)],
    )
    trainer.fit(Wide(), DataLoader(TensorDataset(torch.randn(2 * ranks, width)), batch_size=2))


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def consolidate_peak(ckpt: str, out: str, buffer_mb: int) -> int:
    """Consolidate `ckpt` into `out` (in a child): the child's peak."""
    from lightning_zoff.consolidate import main

    main([ckpt, out, "--buffer-mb", str(buffer_mb), "--no-progress"])
    return peak_rss()


def import_peak() -> int:
    """The peak of a child that only imports the consolidation."""
    import lightning_zoff.consolidate  # noqa: F401

    return peak_rss()


def model_bytes(file: str) -> tuple[int, int]:
    """The bytes and the number of tensors of a consolidated file's state dict (in a child)."""
    import torch

    state = torch.load(file, mmap=True, weights_only=True)["state_dict"]
    return sum(t.nbytes for t in state.values()), len(state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--buffer-mb", type=int, default=256)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="zoff_bench_consolidate_"))
    ckpt = work / "ck" / "step1.ckpt"
    if not ckpt.exists():
        run_function(build, dict(work=str(work), width=args.width, blocks=args.blocks, ranks=args.ranks)).check()
    out = work / "model.pt"
    consolidated = dict(ckpt=str(ckpt), out=str(out), buffer_mb=args.buffer_mb)
    peak = run_function(consolidate_peak, consolidated, output="capture").check().results[0]
    base = run_function(import_peak, output="capture").check().results[0]
    size, count = run_function(model_bytes, dict(file=str(out)), output="capture").check().results[0]
    print(f"model: {size / 2**30:.2f} GiB fp32 ({count} tensors), checkpoint written by {args.ranks} rank(s)")
    print(f"consolidate peak RSS: {peak / 2**30:.2f} GiB = {peak / size:.2f}x the model"
          f" (buffer {args.buffer_mb} MiB; the interpreter and imports alone: {base / 2**30:.2f} GiB)")
    print(f"above the imports: {(peak - base) / 2**30:.2f} GiB = {(peak - base) / size:.2f}x the model")

