"""An error that ends the ranks of a node, shown once: the first rank of the node whose error reaches the top prints
its traceback; a rank failing after it exits without a word.

The ranks usually fail together (the same bad input reaches each) or one after another (one fails, the others then
lose it in a collective); either way the first failure is the one to read. Under the subprocess launcher the main
process (local rank 0) makes a directory for its node before it starts the other ranks; the first rank to fail claims
it. Lightning kills every process of the node as soon as one of the started ranks exits with an error, so a quiet rank
exits only once the message is out (and, when the main process printed it, once that process has ended).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import psutil

ENV = "ZOFF_NODE_ERRORS"  # the node's directory, inherited by the ranks the main process starts
_PREFIX = "zoff-node-errors-"
_FIRST = "first"  # the local rank that failed first
_SHOWN = "shown"  # its message is out
_QUIET_WAIT_S = 30.0
_installed = False


def prepare_node() -> None:
    """In the main process, right before it starts the node's other ranks. The directory goes when the process ends
    with no rank failed; after a failure a rank may still look for it, so the next launch on the machine removes it."""
    for stale in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*"):
        pid = stale.name[len(_PREFIX):].split("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    board = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
    os.environ[ENV] = str(board)
    atexit.register(_remove_unless_failed, board)


def report_once_per_node(local_rank: int) -> None:
    """In each rank of a node the main process prepared, once its process group exists: wrap the hook that prints an
    uncaught exception (torch's, which prefixes each line with the rank) so that only the node's first failure prints.
    Anything but an `Exception` (KeyboardInterrupt) prints as before."""
    global _installed
    board = os.environ.get(ENV)
    if board is None or _installed:
        return
    _installed = True
    previous = sys.excepthook
    main_pid = os.getpid() if local_rank == 0 else os.getppid()  # the main process started this rank

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(kind, Exception):
            previous(kind, error, tb)
        elif _claim(Path(board), local_rank):
            previous(kind, error, tb)
            _touch(Path(board) / _SHOWN)
        elif local_rank != 0:
            _wait_for_the_message(Path(board), main_pid)

    sys.excepthook = hook


def _claim(board: Path, local_rank: int) -> bool:
    """Whether this rank is the node's first to fail (it then says so in `board`)."""
    try:
        fd = os.open(board / _FIRST, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    except OSError:  # the directory is gone: the main process ended with no failure, so nobody spoke for the node
        return True
    with os.fdopen(fd, "w") as first:
        first.write(str(local_rank))
    return True


def _wait_for_the_message(board: Path, main_pid: int) -> None:
    deadline = time.monotonic() + _QUIET_WAIT_S
    while not (board / _SHOWN).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        first = (board / _FIRST).read_text()
    except OSError:
        return
    while first == "0" and os.getppid() == main_pid and time.monotonic() < deadline:
        time.sleep(0.05)


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):  # the directory is gone: nobody waits for it
        path.touch()


def _remove_unless_failed(board: Path) -> None:
    if not (board / _FIRST).exists():
        shutil.rmtree(board, ignore_errors=True)
