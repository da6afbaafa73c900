"""Checkpoints on disk, and the checks that refuse a damaged or foreign one before anything is loaded.

Sharded (a directory): ``rank{r}.safetensors``, one file per rank (`rank_files`), holds that rank's rows of every
tensor by name: the module's state dict with fp32 master weights under ``state_dict/`` (a frozen parameter as the
model holds it), the moments and step counts under ``optimizer_0/``; any world size reads them back. ``meta.pt``
holds the rest of Lightning's checkpoint (loops, LR schedulers, callbacks, loss scaler, param groups) and zoff's
description under ``"zoff"`` (format version, tensor names and shapes, the rank files and their sizes); it is written
last. Directories of format version 1 (one torch.distributed.checkpoint file per tensor, `dcp_files`) still load.
Full: one ``torch.save`` file holding whole tensors, loadable without zoff.

Both are written under a temporary name next to the target and renamed when complete, so a crash during a save
leaves the previous checkpoint whole.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_zoff.checkpoint import dcp_files, pickling, rank_files
from lightning_zoff.checkpoint.rank_files import RankFileError, RankFiles, Rows, Staging

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: the DCP directories of `dcp_files`
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
        pickling.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_full(checkpoint: dict[str, Any], path: Path) -> None:
    """One file with whole tensors (rank 0 only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    partial = partial_path(path)
    remove(partial)
    try:
        _save_file(checkpoint, partial)
    except BaseException:
        remove(partial)
        raise
    commit(partial, path)


def save_sharded(checkpoint: dict[str, Any], path: Path, rank: int, world_size: int,
                 barrier: Callable[[], None]) -> None:
    """A directory: every rank writes its file of its rows of the tensors, rank 0 adds meta.pt. A collective."""
    partial = partial_path(path)
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        recover(path)
        remove(partial)
        partial.mkdir()
    barrier()
    tensors, meta = _split(checkpoint)
    items = {key: rows for key, tensor in _leaves(tensors) if (rows := _rows(tensor, rank)) is not None}
    rank_files.write_rank_file(partial / rank_files.file_name(rank), items, Staging())
    barrier()
    if rank == 0:  # every rank's file is written
        names = [rank_files.file_name(r) for r in range(world_size)]
        meta["zoff"] = {**meta["zoff"], "files": {name: (partial / name).stat().st_size for name in names}}
        try:
            _save_file(meta, partial / META_FILE)
        except BaseException:
            remove(partial)
            raise
        commit(partial, path)
    barrier()


def pickled_part(checkpoint: dict[str, Any], layout: str) -> dict[str, Any]:
    """What of `checkpoint` a save of `layout` ("full" or "sharded") pickles: all of it, or what meta.pt holds."""
    return checkpoint if layout == "full" else _split(checkpoint)[1]


def _split(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tensors the rank files hold, and the rest, for meta.pt."""
    meta = dict(checkpoint)
    tensors = {"state_dict": meta.pop("state_dict")}
    if "optimizer_states" in meta:
        for i, state in enumerate(meta["optimizer_states"]):
            tensors[f"optimizer_{i}"] = state["state"]
        meta["optimizer_states"] = [{"param_groups": s["param_groups"]} for s in meta["optimizer_states"]]
    return tensors, meta


def _leaves(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a nested dict, keyed by its path ("optimizer_0/model.head.weight/exp_avg")."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}/")
        elif isinstance(value, torch.Tensor):
            yield f"{prefix}{key}", value
        else:
            raise TypeError(f"{prefix}{key}: a {type(value).__name__} where a sharded checkpoint holds tensors")


def _rows(tensor: torch.Tensor, rank: int | None) -> Rows | None:
    """The rows of `tensor` this rank holds: its own shard of a DTensor split on dim 0, else the whole tensor, which
    only `rank` 0 writes (None: every rank reads it)."""
    if isinstance(tensor, DTensor):
        mesh, placements = tensor.device_mesh, tuple(tensor.placements)
        if mesh.ndim == 1 and placements == (Shard(0),):
            local, rows, world, rank_of = tensor.to_local(), tensor.shape[0], mesh.size(), mesh.get_local_rank()
            start = rank_files.chunk_start(rows, world, rank_of)
            if start + len(local) != rank_files.chunk_start(rows, world, rank_of + 1):
                raise ValueError(f"a DTensor of {rows} rows whose shard on rank {rank_of} of {world} holds {len(local)}"
                                 " rows, not torch.chunk's")
            return Rows(local, tuple(tensor.shape), start)
        if not all(isinstance(p, Replicate) for p in placements):
            raise ValueError(f"a DTensor placed {placements} on a {mesh.ndim}-D mesh; checkpoints hold Shard(0) on"
                             " one dimension or Replicate")
        tensor = tensor.to_local()
    return Rows(tensor, tuple(tensor.shape), 0) if rank in (0, None) else None


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
        raise _unreadable(file, err) from err
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{file}: holds a {type(checkpoint).__name__}, not a Lightning checkpoint")
    return checkpoint


def is_zoff_checkpoint(path: Path) -> bool:
    """Whether `path` is a zoff checkpoint: a directory with its meta file, or a file that holds zoff's description
    (read memory-mapped: whole weights files are not read through)."""
    if path.is_dir():
        return (path / META_FILE).exists()
    if not path.is_file() or path.suffix == ".safetensors":
        return False
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:
        return False
    return isinstance(checkpoint, dict) and isinstance(checkpoint.get("zoff"), dict)

def _unreadable(file: Path, err: Exception) -> CheckpointError:
    """Why torch.load failed on `file`, told apart: globals its weights-only unpickler refuses (the file is whole), a
    zip archive cut short, or something else."""
    refused = _refused_globals(file, err)
    if refused:
        names = ", ".join(refused[:12]) + (", ..." if len(refused) > 12 else "")
        return CheckpointError(
            f"{file}: torch's weights-only load refuses the global {refused[0]}: the checkpoint is whole but holds"
            " objects of classes outside torch's allowlist (a class of your own or a Hydra/omegaconf config in the"
            " hyperparameters, say). If you trust the file, allow them before loading with"
            f" `torch.serialization.add_safe_globals([{names}])`, or load it fully with `weights_only=False`"
            " (`trainer.fit(..., ckpt_path=..., weights_only=False)`, `fabric.load(path, state, weights_only=False)`)"
        )
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(4)
        f.seek(max(0, size - _ZIP_TAIL))
        tail = f.read()
    if size == 0:
        return CheckpointError(f"{file}: cannot be read: the file is empty (0 bytes)")
    if head != _ZIP_START:
        return CheckpointError(f"{file}: cannot be read: not a torch checkpoint (torch.save writes a zip archive; this"
                               " file does not start as one)")
    if _ZIP_END not in tail:
        return CheckpointError(f"{file}: truncated: its {size} bytes end inside the zip archive torch.save wrote"
                               " (the archive's directory, written last, is missing)")
    return CheckpointError(f"{file}: cannot be read ({err})")


_ZIP_START, _ZIP_END = b"PK\x03\x04", b"PK\x05\x06"
_ZIP_TAIL = 22 + 65535 + 56 + 20  # the end record with its longest comment, after zip64's record and locator


def _refused_globals(file: Path, err: Exception) -> list[str]:
    """The globals torch's weights-only unpickler refuses in `file`, all of them (torch's message names the first
    only); none where `err` is another failure."""
    message = str(err)
    if "Weights only load failed" not in message:
        return []
    first = re.findall(r"GLOBAL (\S+) was not an allowed global", message)
    if not first:
        return []  # not pickled by torch.save at all (a text file fails this way too)
    try:
        every = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except Exception:
        return first
    return first + [name for name in every if name != first[0]]



def check_format(checkpoint: dict[str, Any], path: Path) -> dict[str, Any]:
    """zoff's description of the checkpoint, if it is one this version reads."""
    path = path / META_FILE if path.is_dir() else path  # where the description lives
    info = checkpoint.get("zoff")
    if not isinstance(info, dict) or "format_version" not in info:
        raise CheckpointError(f"{path}: not a lightning_zoff checkpoint (no 'zoff' format information)")
    if info["format_version"] not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: checkpoint format version {info['format_version']}; this lightning_zoff reads versions"
            f" {' and '.join(map(str, READABLE_VERSIONS))}"
        )
    return info


def check_loadable(path: Path, weights_only: bool | None = None) -> dict[str, Any] | None:
    """Refuse what every rank's load would, whatever the model: no checkpoint at `path`, one that cannot be read, one
    not in this version's format, a directory missing data its index names. Reads meta.pt and the index of a
    directory, or the file memory-mapped; changes nothing on disk. What it read (None for a save to recover)."""
    if not path.exists() and _previous(path).exists():
        return None  # a save stopped between its two renames: the load puts the checkpoint back first (`recover`)
    checkpoint = read(path, weights_only)
    info = check_format(checkpoint, path)
    if path.is_dir():
        check_complete(path, info)
    return checkpoint


def check_compatible(checkpoint: dict[str, Any], path: Path, expected: dict[str, list[int]]) -> None:
    """Refuse checkpoints of another format version or another model. Another world size is fine: the load
    reshards."""
    saved = check_format(checkpoint, path)["tensors"]
    path = path / META_FILE if path.is_dir() else path
    missing, unexpected = sorted(expected.keys() - saved.keys()), sorted(saved.keys() - expected.keys())
    shapes = [f"{k} {saved[k]} vs {expected[k]}" for k in expected if k in saved and list(saved[k]) != expected[k]]
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"{path}: written for another model: missing {missing[:5]}, unexpected {unexpected[:5]}, other shapes"
            f" (checkpoint vs model) {shapes[:5]}"
        )


def check_complete(path: Path, info: dict[str, Any]) -> None:
    """Every file of the sharded checkpoint `path` exists and is whole: as long as meta.pt (format 2) or DCP's index
    (format 1) says."""
    if info["format_version"] == 1:
        try:
            dcp_files.check_complete(path)
        except dcp_files.DcpFileError as err:
            raise CheckpointError(str(err)) from err
        return
    for name, size in info["files"].items():
        file = path / name
        if not file.exists():
            raise CheckpointError(f"{file}: missing; {META_FILE} names it")
        if file.stat().st_size != size:
            problem = "truncated" if file.stat().st_size < size else "not the file written"
            raise CheckpointError(f"{file}: {problem}: {file.stat().st_size} bytes, {META_FILE} records {size}")


def rank_file_paths(path: Path, info: dict[str, Any]) -> list[Path]:
    return [path / name for name in info["files"]]


def load_sharded(path: Path, info: dict[str, Any], targets: dict[str, Any]) -> None:
    """Read the tensors of `targets` (DTensors and plain tensors, nested by key) in place, resharded: each rank reads
    the rows it holds, from the host or the accelerator, whatever the world size that wrote them. A collective for
    format 1."""
    check_complete(path, info)
    try:
        if info["format_version"] == 1:
            dcp_files.load(path, targets)
            return
        files, staging = RankFiles(rank_file_paths(path, info)), Staging()
        with torch.no_grad():
            for key, target in _leaves(targets):
                rows = _rows(target, None)
                assert rows is not None
                files.read_into(key, rows.local, rows.start, staging)
    except RankFileError as err:  # names its file, or else the tensor
        raise CheckpointError(str(err) if str(path) in str(err) else f"{path}: {err}") from err
    except Exception as err:
        raise CheckpointError(f"{path}: cannot be loaded: {err}") from err
