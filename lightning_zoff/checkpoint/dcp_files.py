"""Sharded checkpoints of format version 1, read only: torch.distributed.checkpoint (DCP) directories, one data file
per tensor and rank, indexed by ``.metadata``. DCP reads any rows of them at any world size."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

from lightning_zoff._compat import dcp_data_extents


class DcpFileError(RuntimeError):
    """A damaged DCP directory; the message names the file and the problem."""


def check_complete(path: Path) -> None:
    """Every data file the index names exists and is as long as the index says."""
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as err:
        raise DcpFileError(f"{path / '.metadata'}: cannot be read ({err}); the checkpoint is incomplete") from err
    for name, size in sorted(dcp_data_extents(metadata).items()):
        file = path / name
        if not file.exists():
            raise DcpFileError(f"{file}: missing; the checkpoint's index names it")
        if file.stat().st_size < size:
            raise DcpFileError(f"{file}: truncated: {file.stat().st_size} bytes, the checkpoint's index needs {size}")


def load(path: Path, targets: dict[str, Any]) -> None:
    """Read the tensors of `targets` (DTensors and plain tensors, nested by key) in place, resharded. A collective
    when a process group is up."""
    with warnings.catch_warnings():  # without a process group (consolidate) DCP says it runs alone, as it should
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(targets, storage_reader=FileSystemReader(path), checkpoint_id=path)


def weight_specs(path: Path, names: list[str]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Whole shape and dtype of each named tensor of the checkpoint's ``state_dict``."""
    specs = FileSystemReader(path).read_metadata().state_dict_metadata
    found = {}
    for name in names:
        spec = specs.get(f"state_dict.{name}")
        if not isinstance(spec, TensorStorageMetadata):
            raise DcpFileError(f"{path}: the index holds no tensor for {name!r}")
        found[name] = (spec.size, spec.properties.dtype)
    return found
