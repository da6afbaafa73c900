"""Sharded checkpoints of format version 1, as lightning_zoff wrote them before rank files: every rank writes its rows
through torch.distributed.checkpoint (DCP), one file per tensor, and rank 0 adds meta.pt last. zoff only reads this
format now; the tests write it with this writer (the same DCP call and meta.pt as the writer of that version)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from lightning_zoff.checkpoint import files as checkpoint_files


def save_format_1(checkpoint: dict[str, Any], path: Path, rank: int, world_size: int, barrier) -> None:
    partial = checkpoint_files.partial_path(path)
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.mkdir()
    barrier()
    meta = dict(checkpoint)
    tensors = {"state_dict": meta.pop("state_dict")}
    for i, state in enumerate(meta.get("optimizer_states", [])):
        tensors[f"optimizer_{i}"] = state["state"]
    if "optimizer_states" in meta:
        meta["optimizer_states"] = [{"param_groups": s["param_groups"]} for s in meta["optimizer_states"]]
    meta["zoff"] = {**meta["zoff"], "format_version": 1}
    dcp.save(tensors, storage_writer=FileSystemWriter(partial, single_file_per_rank=False))
    if rank == 0:
        with open(partial / checkpoint_files.META_FILE, "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())
        partial.rename(path)
    barrier()


class SaveFormat1(pl.Callback):
    """Saves a sharded checkpoint of format version 1 at optimizer step `step` to `out/epoch=0-step={step}.ckpt`."""

    def __init__(self, step: int, out: Path) -> None:
        self.step, self.out = step, Path(out)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with mock.patch.object(checkpoint_files, "save_sharded", save_format_1):
                trainer.save_checkpoint(self.out / f"epoch=0-step={self.step}.ckpt")
