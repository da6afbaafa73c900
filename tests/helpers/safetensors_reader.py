"""A sharded checkpoint's tensors as the safetensors library reads its rank files: a reader independent of zoff's."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def rank_file_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, whole: a tensor split on dim 0 is its pieces in rank order; one held whole is in
    rank 0's file only."""
    files = sorted(ckpt.glob("rank*.safetensors"), key=lambda f: int(f.stem.removeprefix("rank")))
    pieces: dict[str, list[torch.Tensor]] = {}
    for file in files:
        for key, tensor in load_file(file).items():
            pieces.setdefault(key, []).append(tensor)
    return {key: torch.cat(parts) if parts[0].dim() else parts[0] for key, parts in pieces.items()}


def nested(flat: dict[str, torch.Tensor], prefix: str) -> dict[str, dict[str, torch.Tensor]]:
    """{"optimizer_0/NAME/exp_avg": t, ...} with `prefix` "optimizer_0/" as {NAME: {"exp_avg": t, ...}}."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in flat.items():
        if key.startswith(prefix):
            name, field = key.removeprefix(prefix).split("/")
            out.setdefault(name, {})[field] = tensor
    return out
