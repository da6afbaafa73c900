"""``python -m lightning_zoff.consolidate CKPT_DIR OUT_FILE``: a sharded zoff checkpoint becomes one fp32 file,
``{"state_dict": {name: tensor}, ...}`` with the LightningModule's names (every floating-point tensor in fp32), that
loads without zoff.

Host memory stays bounded by ``--buffer-mb``, whatever the model's size: the file is first written with every
tensor's bytes left empty (``torch.serialization.skip_data``; the tensors behind it are never touched, so the OS
never backs them with memory), then the file is mapped (``torch.load(mmap=True)``, shared) a batch at a time and
the batch's tensors are read from the shards straight into their places in it.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from lightning_zoff.checkpoint import dcp_files, pickling
from lightning_zoff.checkpoint.files import (
    CheckpointError,
    check_complete,
    check_format,
    commit,
    partial_path,
    rank_file_paths,
    read,
    remove,
)
from lightning_zoff.checkpoint.pickling import carried_tensors
from lightning_zoff.checkpoint.rank_files import RankFileError, RankFiles, Staging

# kept in the output next to the weights, so LightningModule.load_from_checkpoint works on it too
_LIGHTNING_KEYS = ("pytorch-lightning_version", "hyper_parameters", "hparams_name")


def consolidate(ckpt_dir: str | Path, out_file: str | Path, buffer_mb: int = 256, progress: bool = True) -> None:
    src, out = Path(ckpt_dir), Path(out_file)
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a sharded checkpoint directory")
    with torch.device("meta"):  # modules in the hyperparameters come back without memory for their weights
        checkpoint = read(src, weights_only=False)
    info = check_format(checkpoint, src)
    names = list(info["tensors"])
    check_complete(src, info)
    try:
        if info["format_version"] == 1:
            _write(checkpoint, src, out, names, dcp_files.weight_specs(src, names), buffer_mb, progress)
            return
        files = RankFiles(rank_file_paths(src, info))
        specs = {name: (torch.Size(info["tensors"][name]), files.dtype(f"state_dict/{name}")) for name in names}
        _write(checkpoint, src, out, names, specs, buffer_mb, progress, files)
    except (dcp_files.DcpFileError, RankFileError) as err:  # names its file, or else the tensor
        raise CheckpointError(str(err) if str(src) in str(err) else f"{src}: {err}") from err


def _write(checkpoint: dict[str, Any], src: Path, out: Path, names: list[str],
           specs: dict[str, tuple[torch.Size, torch.dtype]], buffer_mb: int, progress: bool,
           files: RankFiles | None = None) -> None:
    """Write the skeleton of `out`, then read the weights into it a batch at a time (from `files`, else through
    DCP), and rename it into place."""
    # never touched, so never resident: only their sizes and dtypes reach the skeleton file
    skeleton = {"state_dict": {name: torch.empty(size, dtype=torch.float32 if dtype.is_floating_point else dtype)
                               for name, (size, dtype) in specs.items()}}
    carried = {k: checkpoint[k] for k in _LIGHTNING_KEYS if k in checkpoint}
    skeleton |= carried
    partial = partial_path(out)
    remove(partial)
    with torch.serialization.skip_data():
        pickling.save(skeleton, partial)
    # on a terminal a bar redrawn in place; in a log (not a terminal) one update every 30 s, not many a second
    bar = tqdm(total=sum(t.nbytes for t in skeleton["state_dict"].values()), desc="consolidate", unit="B",
               unit_scale=True, unit_divisor=1024, disable=not progress, mininterval=0.1 if sys.stderr.isatty() else 30)
    staging = Staging()
    for batch in _batches(names, skeleton["state_dict"], buffer_mb << 20):
        # the file mapped shared: each tensor is read straight into its place in it. Mapped anew for each batch, so
        # the pages written so far leave this process and its memory stays one batch.
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED), torch.device("meta"):
            in_file = torch.load(partial, mmap=True, weights_only=False)  # the file just written
        if carried:  # the hyperparameters' tensors with values (a module's buffers), skipped with the rest
            places = carried_tensors({k: in_file[k] for k in carried})
            for place, tensor in zip(places, carried_tensors(carried), strict=True):
                place.copy_(tensor)
            carried = {}
        in_file = in_file["state_dict"]
        if files is None:
            dcp_files.load(src, {"state_dict": {name: in_file[name] for name in batch}})
        else:
            for name in batch:
                files.read_into(f"state_dict/{name}", in_file[name], 0, staging)
        bar.update(sum(in_file[name].nbytes for name in batch))
        del in_file
    with open(partial, "rb") as f:
        os.fsync(f.fileno())  # the mapped pages written, like any other
    bar.close()
    commit(partial, out)


def _batches(names: list[str], tensors: dict[str, torch.Tensor], budget: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for name in names:
        if batch and size + tensors[name].nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(name)
        size += tensors[name].nbytes
    if batch:
        yield batch
