"""Whole weights as users have them, for `ZoffStrategy.load_full_state_dict`: a directory written by Hugging Face
`save_pretrained` (``model.safetensors``, sharded ``model.safetensors.index.json``, or ``pytorch_model.bin``), one
``.safetensors`` file, or a ``torch.save`` file (a Lightning checkpoint's ``state_dict`` and Fabric's ``{"model": ...}``
included); and their names mapped to the module's.

safetensors files are read lazily: a rank reads only its own rows of each tensor it loads.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_zoff.sharding import local_chunk

# what save_pretrained writes (transformers < 5 wrote the pytorch_model ones), in the order they are looked for
PRETRAINED_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                    "pytorch_model.bin.index.json")


class OnDisk:
    """A tensor of a safetensors file, read when it is copied: a rank's dim-0 rows alone, or whole."""

    def __init__(self, file: Any, name: str) -> None:
        self.file, self.name = file, name

    def local_chunk(self, world_size: int, rank: int) -> torch.Tensor:
        """`sharding.local_chunk` of the tensor (torch.chunk's cut, as FSDP2's), reading only those rows."""
        rows = self.file.get_slice(self.name)
        shape = rows.get_shape()
        if not shape:
            return local_chunk(self.whole(), world_size, rank)
        per_rank = -(-shape[0] // world_size)
        start = min(rank * per_rank, shape[0])
        return rows[start : min(start + per_rank, shape[0])]

    def whole(self) -> torch.Tensor:
        return self.file.get_tensor(self.name)

    def shape_on_disk(self) -> list[int]:
        return list(self.file.get_slice(self.name).get_shape())


def read_weights(path: str | Path) -> dict[str, torch.Tensor | OnDisk]:
    """The tensors at `path` by their names in the file: torch.save files memory-mapped, safetensors ones lazily."""
    path = Path(path)
    if path.is_dir():
        found = [path / name for name in PRETRAINED_FILES if (path / name).exists()]
        if not found:
            raise FileNotFoundError(
                f"{path}: holds none of {', '.join(PRETRAINED_FILES)} (what Hugging Face save_pretrained writes);"
                " pass the weights file itself. A zoff checkpoint directory resumes with trainer.fit(ckpt_path=...)."
            )
        path = found[0]
    if path.name.endswith(".index.json"):  # shards: {"weight_map": {name: file}}
        files = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        return {name: t for file in files for name, t in _read_file(path.parent / file).items()}
    return _read_file(path)


def _read_file(path: Path) -> dict[str, torch.Tensor | OnDisk]:
    if path.suffix == ".safetensors":
        try:
            from safetensors import safe_open
        except ImportError as err:
            raise ImportError(f"{path}: reading safetensors files needs the safetensors package"
                              " (pip install safetensors).") from err
        file = safe_open(str(path), framework="pt", device="cpu")
        return {name: OnDisk(file, name) for name in file.keys()}  # noqa: SIM118  (safetensors' handle has no __iter__)
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    for key in ("state_dict", "model"):  # a Lightning checkpoint; what `fabric.save(path, {"model": m})` wrote
        if isinstance(state.get(key), dict):
            return state[key]
    return state


def to_module_names(
    weights: dict[str, Any], expected: Collection[str], module: nn.Module, prefix: str | None = None
) -> tuple[dict[str, Any], str]:
    """`weights` with `prefix` put before every name, and that prefix. By default it is the one under which most names
    are among `expected` (the module's): none, or a submodule's name and a dot (``"model."`` for a Hugging Face model
    that a LightningModule holds as ``self.model``). Raises when no name matches at all, or several prefixes tie."""
    tried = [prefix] if prefix is not None else ["", *(f"{name}." for name, _ in module.named_modules() if name)]
    hits = {p: sum(p + name in expected for name in weights) for p in tried}
    best = max(hits.values())
    if best == 0:
        raise ValueError(
            f"none of the {len(weights)} names in the weights is a name of the {type(module).__name__} under"
            f" {'prefix ' + repr(prefix) if prefix is not None else 'any of its submodule prefixes'}: the weights"
            f" hold {sorted(weights)[:4]}, the module {sorted(expected)[:4]}. Pass prefix= to put before the"
            " weights' names, or weights of this model."
        )
    chosen = [p for p, n in hits.items() if n == best]
    if len(chosen) > 1:
        raise ValueError(f"the weights' names match the module's equally under the prefixes {chosen}; pass prefix=.")
    return {chosen[0] + name: value for name, value in weights.items()}, chosen[0]
