"""Checkpoints on disk, and the checks that refuse a damaged or foreign one before anything is loaded.

Sharded (a directory): torch.distributed.checkpoint (DCP) files hold every tensor by name: the module's state dict
with fp32 master weights under ``state_dict``, the moments and step counts under ``optimizer_0``. DCP reshards
them to any world size on load. ``meta.pt`` holds the rest of Lightning's checkpoint (loops, LR schedulers,
callbacks, loss scaler, param groups) and zoff's description under ``"zoff"`` (format version, tensor names and
shapes); it is written last. Full: one ``torch.save`` file holding whole tensors, loadable without zoff.

Both are written under a temporary name next to the target and renamed when complete, so a crash during a save
leaves the previous checkpoint whole.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from lightning_zoff._compat import dcp_data_extents

FORMAT_VERSION = 1
META_FILE = "meta.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


def zoff_info(state_dict: dict[str, torch.Tensor], layout: str, world_size: int) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, "layout": layout, "world_size": world_size,
            "tensors": {name: list(t.shape) for name, t in state_dict.items()}}


# -- writing ----------------------------------------------------------------------------------------------------


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.zoff-partial")


def _previous(path: Path) -> Path:
    return path.with_name(f".{path.name}.zoff-previous")


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def recover(path: Path) -> None:
    """Finish a replacement a crash interrupted between its two renames (rank 0 only)."""
    previous = _previous(path)
    if previous.exists():
        if path.exists():
            remove(previous)
        else:
            previous.rename(path)


def commit(partial: Path, path: Path) -> None:
    # rename(2) replaces a file atomically but not a non-empty directory: move that aside first. `recover` puts it
    # back if we die in between.
    if path.exists() and (path.is_dir() or partial.is_dir()):
        previous = _previous(path)
        remove(previous)
        path.rename(previous)
        partial.rename(path)
        remove(previous)
    else:
        os.replace(partial, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_full(checkpoint: dict[str, Any], path: Path) -> None:
    """One file with whole tensors (rank 0 only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    partial = partial_path(path)
    remove(partial)
    _save_file(checkpoint, partial)
    commit(partial, path)


def save_sharded(checkpoint: dict[str, Any], path: Path, rank: int, barrier: Callable[[], None]) -> None:
    """A directory: every rank writes its rows of the tensors through DCP, rank 0 adds meta.pt. A collective."""
    partial = partial_path(path)
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        recover(path)
        remove(partial)
        partial.mkdir()
    barrier()
    tensors, meta = _split(checkpoint)
    # One file per tensor: DCP's writer keeps every tensor of a file alive until the file is done, and ours are views
    # of the engine's flat buffers, which it clones first. With one file per rank that was a second copy of the whole
    # checkpoint in host memory (the 7B GPT's main job was killed for it on a 128 GB host); per tensor it is one.
    dcp.save(tensors, storage_writer=FileSystemWriter(partial, single_file_per_rank=False))
    if rank == 0:  # DCP returns on rank 0 once every rank's files are written
        _save_file(meta, partial / META_FILE)
        commit(partial, path)
    barrier()


def _split(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tensors DCP writes, and the rest, for meta.pt."""
    meta = dict(checkpoint)
    tensors = {"state_dict": meta.pop("state_dict")}
    if "optimizer_states" in meta:
        for i, state in enumerate(meta["optimizer_states"]):
            tensors[f"optimizer_{i}"] = state["state"]
        meta["optimizer_states"] = [{"param_groups": s["param_groups"]} for s in meta["optimizer_states"]]
    return tensors, meta


# -- reading ----------------------------------------------------------------------------------------------------


def read(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """Lightning's checkpoint: meta.pt of a directory (tensors stay on disk) or the whole file (memory-mapped)."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    file = path / META_FILE if path.is_dir() else path
    if path.is_dir() and not file.exists():
        raise CheckpointError(
            f"{path}: no {META_FILE}, which a zoff checkpoint writes last: the save did not finish, or the directory is"
            " not a zoff checkpoint"
        )
    try:
        checkpoint = torch.load(file, map_location="cpu", mmap=not path.is_dir(), weights_only=weights_only)
    except Exception as err:
        raise CheckpointError(
            f"{file}: cannot be read ({err}); the file is truncated or not a torch checkpoint"
        ) from err
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{file}: holds a {type(checkpoint).__name__}, not a Lightning checkpoint")
    return checkpoint


def check_format(checkpoint: dict[str, Any], path: Path) -> dict[str, Any]:
    """zoff's description of the checkpoint, if it is one this version reads."""
    path = path / META_FILE if path.is_dir() else path  # where the description lives
    info = checkpoint.get("zoff")
    if not isinstance(info, dict) or "format_version" not in info:
        raise CheckpointError(f"{path}: not a lightning_zoff checkpoint (no 'zoff' format information)")
    if info["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {info['format_version']}; this lightning_zoff reads version"
            f" {FORMAT_VERSION}"
        )
    return info


def check_loadable(path: Path, weights_only: bool | None = None) -> None:
    """Refuse what every rank's load would, whatever the model: no checkpoint at `path`, one that cannot be read, one
    not in this version's format, a directory missing data its index names. Reads meta.pt and the index of a
    directory, or the file memory-mapped; changes nothing on disk."""
    if not path.exists() and _previous(path).exists():
        return  # a save stopped between its two renames: the load puts the checkpoint back first (`recover`)
    check_format(read(path, weights_only), path)
    if path.is_dir():
        check_complete(path)


def check_compatible(checkpoint: dict[str, Any], path: Path, expected: dict[str, list[int]]) -> None:
    """Refuse checkpoints of another format version or another model. Another world size is fine: DCP reshards."""
    saved = check_format(checkpoint, path)["tensors"]
    path = path / META_FILE if path.is_dir() else path
    missing, unexpected = sorted(expected.keys() - saved.keys()), sorted(saved.keys() - expected.keys())
    shapes = [f"{k} {saved[k]} vs {expected[k]}" for k in expected if k in saved and list(saved[k]) != expected[k]]
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"{path}: written for another model: missing {missing[:5]}, unexpected {unexpected[:5]}, other shapes"
            f" (checkpoint vs model) {shapes[:5]}"
        )


def check_complete(path: Path) -> None:
    """Every DCP data file the index names exists and is as long as the index says."""
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as err:
        raise CheckpointError(f"{path / '.metadata'}: cannot be read ({err}); the checkpoint is incomplete") from err
    for name, size in sorted(dcp_data_extents(metadata).items()):
        file = path / name
        if not file.exists():
            raise CheckpointError(f"{file}: missing; the checkpoint's index names it")
        if file.stat().st_size < size:
            raise CheckpointError(
                f"{file}: truncated: {file.stat().st_size} bytes, the checkpoint's index needs {size}"
            )


def load_sharded(path: Path, targets: dict[str, Any]) -> None:
    """Read the tensors of `targets` (DTensors and plain tensors, nested by key) in place, resharded. A collective."""
    check_complete(path)
    try:
        dcp.load(targets, checkpoint_id=path)
    except Exception as err:
        raise CheckpointError(f"{path}: cannot be loaded: {err}") from err
