"""A rank's exception carried to the main process of a forked or spawned launch: the rank saves it (pickled, with
its traceback as text) before torch's wrapper reports it, and the launcher raises it there as itself, the rank's
traceback as its cause, in place of torch's `ProcessRaisedException` (which holds only the text). A caller can then
catch the error's own type: the main job prints a plan's refusal as one line."""

from __future__ import annotations

import pickle
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.multiprocessing import ProcessRaisedException


class RankTraceback(Exception):
    """The traceback of an exception raised in a rank, shown as the cause of that exception in the main process."""


def run_saving_error(error_dir: str, process_idx: int, run: Callable[[], object]) -> None:
    """In the rank: `run()` (the launcher's own wrapping of the rank's function); an exception it raises is saved for
    `raised_as_themselves` first, and then raised on, for torch's wrapper to report as well."""
    try:
        run()
    except Exception as err:
        save_error(error_dir, process_idx, err)
        raise


def save_error(error_dir: str, process_idx: int, err: Exception) -> None:
    """In the rank: `err` and its traceback into `error_dir`, for `raised_as_themselves`."""
    text = "".join(traceback.format_exception(err))
    try:
        payload = pickle.dumps((err, text))
    except Exception:  # an exception that cannot be pickled reaches the main process as torch's report
        return
    Path(error_dir, str(process_idx)).write_bytes(payload)


def load_error(error_dir: str, process_idx: int) -> tuple[Exception, str] | None:
    try:
        return pickle.loads(Path(error_dir, str(process_idx)).read_bytes())
    except Exception:  # not written, or its class cannot be rebuilt here
        return None


@contextmanager
def raised_as_themselves(global_rank: Callable[[int], int]) -> Iterator[str]:
    """In the main process, around a launch: a directory for the ranks' `run_saving_error`; torch's report of a rank's
    exception becomes the exception the rank saved, raised as itself (`global_rank`: of a process index)."""
    error_dir = tempfile.mkdtemp(prefix="zoff-errors-")
    try:
        yield error_dir
    except ProcessRaisedException as report:
        raised = load_error(error_dir, report.error_index)
        if raised is None:
            raise
        error, text = raised
        raise error from RankTraceback(f"raised in rank {global_rank(report.error_index)}:\n{text}")
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)
