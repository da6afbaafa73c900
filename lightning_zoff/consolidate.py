"""``python -m lightning_zoff.consolidate CKPT_DIR OUT_FILE [--buffer-mb 256] [--no-progress]``: the command that turns
a sharded zoff checkpoint into one fp32 file that loads without zoff. The work, and how it bounds host memory, is
`lightning_zoff.checkpoint.consolidate`'s; this module is its command line, as `lightning_zoff.cli` is the CLI's."""

from __future__ import annotations

import argparse
import sys

from lightning_zoff.checkpoint import consolidate as consolidation
from lightning_zoff.checkpoint.files import CheckpointError


def main(argv: list[str] | None = None) -> None:
    description = (consolidation.__doc__ or "").split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="python -m lightning_zoff.consolidate", description=description)
    parser.add_argument("ckpt_dir", help="a sharded zoff checkpoint (directory)")
    parser.add_argument("out_file", help="the fp32 file to write")
    parser.add_argument("--buffer-mb", type=int, default=256, help="tensors read per batch (MiB); bounds the memory")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        consolidation.consolidate(args.ckpt_dir, args.out_file, args.buffer_mb, progress=not args.no_progress)
    except CheckpointError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
