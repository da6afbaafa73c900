"""How a Hydra job of this project stops before training (scripts/train.py, scripts/train_fabric.py): one line,
exit status 2, and no job directory left behind."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import NoReturn

from hydra.core.hydra_config import HydraConfig


def refuse(message: str, run_dir: Path) -> NoReturn:
    """Stop before training: one line, the value named (a traceback would say no more), exit status 2, and no job
    directory left behind (Hydra made it at the job's start; the logger's empty version directory, where the ranks
    started), unless it held more than Hydra writes there at the start: a directory used before keeps all it had."""
    print(f"error: {message}", file=sys.stderr)
    cwd = Path.cwd()
    hydra_files = {".hydra", f"{HydraConfig.get().job.name}.log"}
    others = [entry for entry in run_dir.iterdir() if entry.name not in hydra_files]
    empty = all(entry.is_dir() and not any(p.is_file() for p in entry.rglob("*")) for entry in others)
    if run_dir != cwd and empty:
        shutil.rmtree(run_dir)
        for parent in run_dir.parents:  # outputs/<date>/ and outputs/ when they are empty now; a sweep's stays
            if parent == cwd or not parent.is_relative_to(cwd) or any(parent.iterdir()):
                break
            parent.rmdir()
    sys.exit(2)
