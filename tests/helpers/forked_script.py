"""`python SCRIPT ARGS` in `cwd`, run in a fork of the test process: the script's `__main__` (Hydra and all) with its
own stdout, stderr, exit status and process group, without a new interpreter's 4 s of importing Lightning on 2 cores.

What the fork keeps of the test process: the modules it imported (a kernel it loaded stays loaded) and pytest's
warning capture (a warning is recorded, not printed). A test about those runs the script in an interpreter of its own.
Logging is set back as a new interpreter has it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


def run_forked(script: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """What `subprocess.run([sys.executable, script, *args], cwd=cwd, capture_output=True, text=True)` returns; at
    the timeout the script and its ranks are killed (exit status -9)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+", errors="backslashreplace") as err:
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.setpgid(0, 0)  # a process group of its own (set by both, whichever comes first): its ranks join it
                os.chdir(cwd)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout, sys.stderr = out, err
                _logging_as_in_a_new_interpreter()
                code = _main(Path(script), args)
            finally:
                os._exit(code)
        with contextlib.suppress(OSError):  # the child's own call may have come first
            os.setpgid(pid, pid)  # before any kill of the group at the timeout
        deadline = time.monotonic() + timeout
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                done = os.waitpid(pid, 0)
                break
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([str(script), *args], os.waitstatus_to_exitcode(done[1]), out.read(),
                                           err.read())


def _logging_as_in_a_new_interpreter() -> None:
    """As a script finds logging once it imported Lightning: no handler on the root (pytest's go), so Lightning's own
    loggers print to stderr themselves and do not propagate (lightning/pytorch/__init__.py; under pytest they
    propagate to the root, and through the handlers Hydra gives it, to stdout)."""
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [logging.StreamHandler()]
        logger.propagate = False


def _main(script: Path, args: tuple[str, ...]) -> int:
    """The exit status of `script`'s `__main__` with `args`, as Python gives it."""
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))  # as for `python SCRIPT`: its neighbours import
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0
