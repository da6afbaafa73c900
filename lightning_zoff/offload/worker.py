"""One background thread that runs the engine's host work in priority order while the accelerator computes.

A task may say when it is ready (a gradient copy that has not finished yet): the thread then runs the most urgent
task that is ready, and blocks inside a task only when none is, so it never idles waiting for the accelerator
while other work is queued. The kernels release the GIL, so the thread runs beside the training loop's Python.
An error in a task is kept and raised in the training thread at its next call into the worker, so nothing fails
silently in the background.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Callable


class HostWorker:
    def __init__(self, name: str = "zoff-host-worker") -> None:
        self._tasks: list[tuple[int, int, Callable[[], None], Callable[[], bool] | None]] = []  # sorted
        self._order = itertools.count()  # first in, first out within a priority
        self._cond = threading.Condition()
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, priority: int, task: Callable[[], None], ready: Callable[[], bool] | None = None) -> None:
        """Queue `task`; lower `priority` runs first, among the tasks whose `ready()` holds."""
        self.raise_error()
        with self._cond:
            bisect.insort(self._tasks, (priority, next(self._order), task, ready), key=lambda t: t[:2])
            self._cond.notify_all()

    def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Block until `predicate()` holds (tasks call `notify` when they change what it reads)."""
        with self._cond:
            self._cond.wait_for(lambda: predicate() or self._error is not None)
        self.raise_error()

    def wait_idle(self) -> None:
        self.wait_until(lambda: not self._tasks and not self._busy)

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"zoff: the host worker failed: {error!r}") from error

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._tasks or self._closed)
                if self._closed:
                    return
                index = next((i for i, t in enumerate(self._tasks) if t[3] is None or t[3]()), 0)
                task = self._tasks.pop(index)[2]  # none ready: the most urgent, which waits inside
                self._busy = True
            try:
                task()
            except BaseException as error:  # handed to the training thread; the queue is dropped with it
                with self._cond:
                    self._error = error
                    self._tasks.clear()
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
