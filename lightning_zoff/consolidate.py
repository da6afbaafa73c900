"""``python -m lightning_zoff.consolidate CKPT_DIR OUT_FILE``: a sharded zoff checkpoint becomes one fp32 file,
``{"state_dict": {name: tensor}, ...}`` with the LightningModule's names, that loads without zoff.

Host memory stays bounded by ``--buffer-mb``, whatever the model's size: the file is first written with every
tensor's bytes left empty (``torch.serialization.skip_data``; the tensors behind it are never touched, so the OS
never backs them with memory), then the tensors are read from the shards a batch at a time and written into
their places in the file.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from lightning_zoff.checkpoint_files import CheckpointError, check_complete, check_format, commit, partial_path, read, remove

# kept in the output next to the weights, so LightningModule.load_from_checkpoint works on it too
_LIGHTNING_KEYS = ("pytorch-lightning_version", "hyper_parameters", "hparams_name")
_LOCAL_HEADER = struct.Struct("<4s22sHH")  # zip local file header: signature ... name length, extra length


def consolidate(ckpt_dir: str | Path, out_file: str | Path, buffer_mb: int = 256, progress: bool = True) -> None:
    src, out = Path(ckpt_dir), Path(out_file)
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a sharded checkpoint directory")
    checkpoint = read(src, weights_only=False)
    names = list(check_format(checkpoint, src)["tensors"])
    check_complete(src)
    reader = FileSystemReader(src)
    specs = reader.read_metadata().state_dict_metadata
    shapes = {}
    for name in names:
        spec = specs.get(f"state_dict.{name}")
        if spec is None or not hasattr(spec, "size"):
            raise CheckpointError(f"{src}: the index holds no tensor for {name!r}")
        shapes[name] = (spec.size, spec.properties.dtype)
    # never touched, so never resident: only their sizes and dtypes reach the skeleton file
    skeleton = {"state_dict": {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in shapes.items()}}
    skeleton |= {k: checkpoint[k] for k in _LIGHTNING_KEYS if k in checkpoint and not _has_tensor(checkpoint[k])}
    partial = partial_path(out)
    remove(partial)
    with torch.serialization.skip_data():
        torch.save(skeleton, partial)
    offsets = dict(zip(names, _data_offsets(partial, [t.nbytes for t in skeleton["state_dict"].values()])))
    bar = _Progress(sum(t.nbytes for t in skeleton["state_dict"].values()), progress)
    with open(partial, "r+b") as f:
        for batch in _batches(names, skeleton["state_dict"], buffer_mb << 20):
            loaded = {name: torch.empty(shapes[name][0], dtype=shapes[name][1]) for name in batch}
            with warnings.catch_warnings():  # its note that this process runs alone would cut into the bar
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load({"state_dict": loaded}, storage_reader=reader, checkpoint_id=src)
            for name, tensor in loaded.items():
                _write_at(f.fileno(), tensor, offsets[name])
                bar.update(tensor.nbytes)
        os.fsync(f.fileno())
    bar.close()
    commit(partial, out)


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    return isinstance(obj, (list, tuple)) and any(_has_tensor(v) for v in obj)


def _data_offsets(path: Path, nbytes: list[int]) -> list[int]:
    """Where the bytes of each tensor's storage start in a torch.save zip file, in the order the tensors were
    pickled (torch names storage records data/0, data/1, ...)."""
    with zipfile.ZipFile(path) as archive:
        records = {info.filename.split("/data/", 1)[1]: info for info in archive.infolist() if "/data/" in info.filename}
    if sorted(records) != sorted(map(str, range(len(nbytes)))):
        raise RuntimeError(f"{path}: expected {len(nbytes)} storage records, found {sorted(records)}")
    offsets = []
    with open(path, "rb") as f:
        for key, size in enumerate(nbytes):
            info = records[str(key)]
            if info.file_size != size or info.compress_type != zipfile.ZIP_STORED:
                raise RuntimeError(f"{path}: record data/{key} holds {info.file_size} bytes, tensor {key} has {size}")
            f.seek(info.header_offset)
            signature, _, name_len, extra_len = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
            if signature != b"PK\x03\x04":
                raise RuntimeError(f"{path}: no zip entry header at byte {info.header_offset}")
            offsets.append(info.header_offset + _LOCAL_HEADER.size + name_len + extra_len)
    return offsets


def _batches(names: list[str], tensors: dict[str, torch.Tensor], budget: int) -> Iterator[list[str]]:
    batch, size = [], 0
    for name in names:
        if batch and size + tensors[name].nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(name)
        size += tensors[name].nbytes
    if batch:
        yield batch


def _write_at(fd: int, tensor: torch.Tensor, offset: int) -> None:
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class _Progress:
    """tqdm when installed, else one line rewritten in place."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self.tqdm = total, 0, enabled, None
        if enabled:
            try:
                from tqdm import tqdm

                self.tqdm = tqdm(total=total, unit="B", unit_scale=True, desc="consolidate")
            except ImportError:
                pass

    def update(self, n: int) -> None:
        self.done += n
        if self.tqdm is not None:
            self.tqdm.update(n)
        elif self.enabled:
            print(f"\rconsolidate: {self.done / 2**20:,.0f} / {self.total / 2**20:,.0f} MiB", end="", file=sys.stderr)

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
        elif self.enabled:
            print(file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_zoff.consolidate", description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt_dir", help="a sharded zoff checkpoint (directory)")
    parser.add_argument("out_file", help="the fp32 file to write")
    parser.add_argument("--buffer-mb", type=int, default=256, help="tensors read per batch (MiB); bounds the memory")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        consolidate(args.ckpt_dir, args.out_file, args.buffer_mb, progress=not args.no_progress)
    except CheckpointError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
