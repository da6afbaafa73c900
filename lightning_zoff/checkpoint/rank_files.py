"""One file per rank: the tensors of a sharded checkpoint (format version 2).

Each rank writes ``rank{r}.safetensors``: a safetensors file (an 8-byte header length, a JSON header, then every
tensor's bytes) holding its own rows of each tensor split on dim 0, and, in rank 0's file, the tensors every rank holds
whole (buffers, step counts). Where each file's rows sit in the whole tensor is in the header's metadata
(``"zoff_rows": {key: [first row, whole shape]}``), so any world size reads any rows back: a rank reads, from each file
that holds some of them, the rows it needs now.

The bytes go to the file straight from the state where it lives, without a second copy of it: a host tensor is
written from its own memory, one elsewhere (the GPU) through a bounded staging buffer a piece at a time; reading
mirrors that, into the tensors themselves. So a save or a load needs the state plus that buffer, whatever the model.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

STAGING_BYTES = 64 << 20
ROWS_KEY = "zoff_rows"

_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


class RankFileError(RuntimeError):
    """A rank file that cannot be read, or that lacks rows a load needs; the message names the file or the tensor."""


def file_name(rank: int) -> str:
    return f"rank{rank}.safetensors"


@dataclass(frozen=True)
class Rows:
    """Rows ``[start, start + rows)`` of the tensor of shape `shape`, split on dim 0, held as `local` (a 0-dim tensor
    counts as one row)."""

    local: torch.Tensor
    shape: tuple[int, ...]
    start: int


def chunk_start(rows: int, world_size: int, rank: int) -> int:
    """The first row of `rank`'s dim-0 shard, as FSDP2 and DTensor cut it (torch.chunk: ceil(rows / world) each, the
    last ones shorter or empty)."""
    return min(rank * math.ceil(rows / world_size), rows)


def _row_count(shape: tuple[int, ...] | torch.Size) -> int:
    return shape[0] if len(shape) else 1


def _row_numel(shape: tuple[int, ...] | torch.Size) -> int:
    return math.prod(shape[1:]) if len(shape) else 1


class Staging:
    """A bounded host buffer that bytes pass through where they cannot go straight between a tensor and a file: to or
    from the accelerator, or converted to another dtype. Allocated on first use; pinned once it serves a CUDA tensor
    (a faster copy), so a run on the CPU alone never touches CUDA."""

    def __init__(self, nbytes: int = STAGING_BYTES) -> None:
        self.nbytes = max(nbytes, 16)
        self._buffer: torch.Tensor | None = None
        self._pin_refused = False

    def piece_numel(self, dtype: torch.dtype) -> int:
        return max(self.nbytes // dtype.itemsize, 1)

    def view(self, dtype: torch.dtype, numel: int, other: torch.device) -> torch.Tensor:
        """`numel` elements of `dtype` of the buffer, for a copy to or from a tensor on `other`."""
        pin = other.type == "cuda" and not self._pin_refused
        if self._buffer is None or (pin and not self._buffer.is_pinned()):
            self._buffer = self._allocate(pin)
        return self._buffer[: numel * dtype.itemsize].view(dtype)

    def _allocate(self, pin: bool) -> torch.Tensor:
        if pin:
            try:
                return torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # pinning refused (memlock limit): pageable is only slower
                self._pin_refused = True
        return torch.empty(self.nbytes, dtype=torch.uint8)


def _bytes(flat: torch.Tensor) -> memoryview:
    """The bytes of a contiguous 1-D host tensor, without a copy."""
    return flat.view(torch.uint8).numpy().data


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    # zoff's state is contiguous, so this is a view; a non-contiguous tensor (a user's, in the checkpoint dict) is
    # copied, that tensor alone
    return tensor.detach().reshape(-1)


# -- writing ----------------------------------------------------------------------------------------------------


def write_rank_file(path: Path, items: dict[str, Rows], staging: Staging) -> None:
    """Write `items` to `path` in their order and fsync it."""
    header: dict[str, object] = {}
    offset = 0
    for key, rows in items.items():
        if rows.local.dtype not in _CODES:
            raise TypeError(f"{key}: a {rows.local.dtype} tensor; checkpoints hold {sorted(map(str, _CODES))}")
        nbytes = rows.local.numel() * rows.local.element_size()
        header[key] = {"dtype": _CODES[rows.local.dtype], "shape": list(rows.local.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    where = {key: [rows.start, list(rows.shape)] for key, rows in items.items()}
    header["__metadata__"] = {ROWS_KEY: json.dumps(where)}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for rows in items.values():
            _write_tensor(f, _flat(rows.local), staging)
        f.flush()
        os.fsync(f.fileno())


def _write_tensor(f: BinaryIO, flat: torch.Tensor, staging: Staging) -> None:
    if flat.device.type == "cpu":
        f.write(_bytes(flat))
        return
    step = staging.piece_numel(flat.dtype)
    for begin in range(0, flat.numel(), step):
        piece = flat[begin : begin + step]
        buffer = staging.view(flat.dtype, piece.numel(), flat.device)
        buffer.copy_(piece)
        f.write(_bytes(buffer))


# -- reading ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    file: Path
    start: int  # first row of the whole tensor
    rows: int
    dtype: torch.dtype
    offset: int  # of its first byte in the file


class RankFiles:
    """The rank files of one checkpoint: their headers read once, then any rows of any tensor read from them."""

    def __init__(self, files: list[Path]) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self._pieces: dict[str, list[_Piece]] = {}
        for file in files:
            for key, piece, shape in _read_header(file):
                self.shapes[key] = shape
                self.dtypes[key] = piece.dtype
                self._pieces.setdefault(key, []).append(piece)

    def dtype(self, key: str) -> torch.dtype:
        """The dtype `key` was saved in."""
        if key not in self.dtypes:
            raise RankFileError(f"the checkpoint holds no tensor {key!r}")
        return self.dtypes[key]

    def read_into(self, key: str, target: torch.Tensor, start: int, staging: Staging) -> None:
        """Fill `target` (contiguous; on the host or the accelerator) with rows ``[start, start + len(target))`` of
        `key`, converted to its dtype where the file holds another."""
        self.dtype(key)  # there at all
        shape = self.shapes[key]
        if len(shape) != target.dim() or list(shape[1:]) != list(target.shape[1:]) \
                or start + _row_count(target.shape) > _row_count(shape):
            raise RankFileError(f"{key}: rows of shape {list(target.shape)} from row {start} asked, the checkpoint"
                                f" holds shape {list(shape)}")
        if not target.is_contiguous():
            raise ValueError(f"{key}: a checkpoint loads into contiguous tensors only")
        flat, row_numel = target.detach().view(-1), _row_numel(shape)
        end = start + _row_count(target.shape)
        covered = start
        for piece in sorted(self._pieces[key], key=lambda p: p.start):
            lo, hi = max(start, piece.start), min(end, piece.start + piece.rows)
            if lo >= hi:
                continue
            if lo > covered:
                break
            size = piece.dtype.itemsize
            _read(piece.file, piece.offset + (lo - piece.start) * row_numel * size, piece.dtype,
                  flat[(lo - start) * row_numel : (hi - start) * row_numel], staging)
            covered = max(covered, hi)
        if covered < end and row_numel:
            raise RankFileError(f"{key}: the checkpoint's files hold no rows {covered} to {end - 1}")


def _read(file: Path, offset: int, dtype: torch.dtype, into: torch.Tensor, staging: Staging) -> None:
    with open(file, "rb") as f:
        f.seek(offset)
        if into.device.type == "cpu" and into.dtype == dtype:
            _read_exactly(f, _bytes(into), file)
            return
        step = staging.piece_numel(dtype)
        for begin in range(0, into.numel(), step):
            piece = into[begin : begin + step]
            buffer = staging.view(dtype, piece.numel(), into.device)
            _read_exactly(f, _bytes(buffer), file)
            piece.copy_(buffer)


def _read_exactly(f: BinaryIO, into: memoryview, file: Path) -> None:
    done = 0
    while done < len(into):
        count = f.readinto(into[done:])  # type: ignore[attr-defined]
        if not count:
            raise RankFileError(f"{file}: truncated: it ends inside the bytes of a tensor its header names")
        done += count


def _read_header(file: Path) -> list[tuple[str, _Piece, tuple[int, ...]]]:
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        rows = json.loads(header.pop("__metadata__")[ROWS_KEY])
        return [(key, _Piece(file, rows[key][0], _row_count(entry["shape"]), _DTYPES[entry["dtype"]],
                             8 + length + entry["data_offsets"][0]), tuple(rows[key][1]))
                for key, entry in header.items()]
    except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
        raise RankFileError(f"{file}: cannot be read ({type(err).__name__}: {err}); not a zoff rank file, or"
                            " damaged") from err
