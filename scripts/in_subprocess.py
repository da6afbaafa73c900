"""Runs a training function of a script in a fresh Python process, as a user's run: its own process group, and
Lightning's launcher re-running the same command line for the other ranks. The check scripts and tests/gpu use it.

    from in_subprocess import call
    reference, = call(run_side, side="reference", steps=30)   # what run_side returned, one entry per rank

The child is `python in_subprocess.py SCRIPT FUNCTION KWARGS_JSON OUT_DIR`; every rank saves what the function
returned (torch.save, so tensors too) as OUT_DIR/rank<LOCAL_RANK>.pt.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def call(fn: Callable, **kwargs: Any) -> list:
    """`fn(**kwargs)` in a fresh process; what it returned on each rank, by local rank. `fn` is a top-level function
    of a script file and `kwargs` are JSON values."""
    script = Path(sys.modules[fn.__module__].__file__).resolve()
    with tempfile.TemporaryDirectory() as out:
        run([sys.executable, str(Path(__file__).resolve()), str(script), fn.__name__, json.dumps(kwargs), out])
        ranks = sorted(Path(out).glob("rank*.pt"), key=lambda path: int(path.stem[len("rank"):]))
        return [torch.load(path, weights_only=False) for path in ranks]


def run(command: list[str]) -> None:
    """Runs `command`, echoing its output, until every process of the run has exited (the other ranks are children
    of the first and share its output pipe, so its end means all have ended). Raises with the last lines on failure."""
    tail = collections.deque(maxlen=60)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # progress lines as they come
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            tail.append(line)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command)} exited with {proc.returncode}:\n{''.join(tail)}")


def _child(script: str, function: str, kwargs: str, out: str) -> None:
    spec = importlib.util.spec_from_file_location(Path(script).stem, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    result = getattr(module, function)(**json.loads(kwargs))
    # Lightning's launcher sets LOCAL_RANK in every process of a run of several devices; one device runs without it
    torch.save(result, Path(out) / f"rank{os.environ.get('LOCAL_RANK', '0')}.pt")


if __name__ == "__main__":
    _child(*sys.argv[1:])
