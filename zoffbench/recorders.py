"""The Lightning callbacks the scripts record training with (harness.py's part that needs Lightning and torch):
`StepRecorder`, each batch's loss and wall time (the check scripts), `WindowTimer`, each optimizer step's phases and
GPU memory (scripts/bench/bench.py), and `AtTrainEnd`, which measures before the teardown; and what the bench's own
loops (fabric_run.py, torchao_run.py) time and read with them: `synchronized_now`, `process_peaks`."""

from __future__ import annotations

import resource
import time
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from zoffbench import alloc_history, gpu_idle


class StepRecorder(pl.Callback):
    """Each training batch's loss and wall time, from the batch's start to its loss's value (`.item()` waits for the
    step's work on the accelerator). With `verbose`, rank 0 prints each step as it ends."""

    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose
        self.losses: list[float] = []
        self.times: list[float] = []
        self._start = 0.0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())
        self.times.append(time.perf_counter() - self._start)
        if self.verbose and trainer.global_rank == 0:
            print(f"step {len(self.losses):3d} loss {self.losses[-1]:.4f} {self.times[-1]:.3f} s", flush=True)


class AtTrainEnd(pl.Callback):
    """Calls `then()` when training ends, before the strategy's teardown (which frees the pinned host memory, and may
    take long): what it reports is out even if the run is cut there."""

    def __init__(self, then: Any) -> None:
        self.then = then

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.then()


Mark = Any  # a torch.cuda.Event recorded on the current stream, or perf_counter's seconds without CUDA


class WindowTimer(pl.Callback):
    """Per optimizer step (window of `accumulate` micro-batches): wall time, forward and backward time, the time the
    GPU waits for the update, the GPU memory after each micro-batch's backward and the window's peak. A window ends
    with its last micro-batch, counted by batch_idx: DeepSpeed has Lightning step the optimizer after every
    micro-batch. Forward and backward are timed by CUDA events on the current stream, read once the window's end has
    synchronized: a synchronize inside the window would stall the overlap zoff runs there."""

    def __init__(self, accumulate: int, windows: int | None = None) -> None:
        self.accumulate = accumulate
        self.windows = windows  # the run's optimizer steps: at the last one's end, the allocator's pools are read
        self.reserved_by_stream: dict[str, dict[str, float]] | None = None
        self.retry_causes: list[dict[str, Any]] | None = None  # ZOFF_BENCH_ALLOC_HISTORY=1 (`alloc_history.py`)
        self.step_peak: dict[str, Any] | None = None  # ... and the blocks the steps held at their peak
        self.gpu_idle: dict[str, Any] | None = None  # ZOFF_BENCH_PROFILE=1: the last step's (`gpu_idle.py`)
        self._profiler: Any = None
        self.first_step_at: float | None = None  # the epoch time the first step started (setup ends there)
        self.step_start: float | None = None
        self.opt_start: float | None = None
        self.steps: list[float] = []
        self.optimizer: list[float] = []
        self.forward: list[float] = []
        self.backward: list[float] = []
        self.zoff: list[dict[str, float]] = []  # the strategy's telemetry at each window's end
        self.after_backward: list[float] = []
        self.window_peak: list[float] = []
        self.alloc_retries: list[int] = []  # the allocator's count at each window's end (cumulative)
        self.retries_before_first = 0
        self.last_in_window = False
        self.batch_mark: Mark = None
        self.loss_mark: Mark = None
        self.forward_marks: list[tuple[Mark, Mark]] = []  # (start, end) of each micro-batch in the window
        self.backward_marks: list[tuple[Mark, Mark]] = []

    @staticmethod
    def _mark() -> Mark:
        if torch.cuda.is_available():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @staticmethod
    def _seconds(marks: list[tuple[Mark, Mark]]) -> float:
        return sum(start.elapsed_time(end) / 1000 if isinstance(start, torch.cuda.Event) else end - start
                   for start, end in marks)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.last_in_window = (batch_idx + 1) % self.accumulate == 0
        if self.first_step_at is None:
            self.first_step_at = time.time()
            self.retries_before_first = alloc_retries()  # setup's own
        if self.step_start is None:
            if self.windows is not None and len(self.steps) == self.windows - alloc_history.LAST_STEPS \
                    and alloc_history.wanted():
                alloc_history.start()
            if self.windows is not None and len(self.steps) == self.windows - 1 and gpu_idle.wanted():
                self._profiler = gpu_idle.start()
            self.step_start = synchronized_now()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
        self.batch_mark = self._mark()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.loss_mark = self._mark()
        self.forward_marks.append((self.batch_mark, self.loss_mark))

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.backward_marks.append((self.loss_mark, self._mark()))
        if torch.cuda.is_available() and self.opt_start is None:  # the allocator's count needs no sync
            self.after_backward.append(torch.cuda.memory_allocated() / 1e9)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self.last_in_window:
            self.opt_start = synchronized_now()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.last_in_window:
            return  # inside an accumulation window
        end = synchronized_now()
        assert self.step_start is not None
        self.steps.append(end - self.step_start)
        self.optimizer.append(end - self.opt_start if self.opt_start is not None else 0.0)
        self.forward.append(self._seconds(self.forward_marks))
        self.backward.append(self._seconds(self.backward_marks))
        self.forward_marks, self.backward_marks = [], []
        self.zoff.append(dict(getattr(trainer.strategy, "telemetry", {})))
        if torch.cuda.is_available():
            self.window_peak.append(torch.cuda.max_memory_allocated() / 1e9)
            self.alloc_retries.append(alloc_retries())
            if len(self.steps) == self.windows:  # in training, before the strategy's teardown empties the cache
                self.reserved_by_stream = reserved_by_stream()
                if alloc_history.wanted():
                    events = alloc_history.stop_and_read()
                    self.retry_causes = alloc_history.retry_causes(events)
                    self.step_peak = alloc_history.peak_live(events)
                if self._profiler is not None:
                    self.gpu_idle, self._profiler = gpu_idle.stop_and_read(self._profiler), None
        self.step_start, self.opt_start = None, None


def synchronized_now() -> float:
    """perf_counter's seconds once the GPU has done what was queued on it (at once without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def alloc_retries() -> int:
    """The CUDA allocator's retries so far: each a cudaMalloc that failed, the cache freed (a synchronisation)."""
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0)) if torch.cuda.is_available() else 0


def retries_per_step(cumulative: list[int], before_first: int = 0) -> list[int] | None:
    """Each window's retries from the allocator's running count at each window's end (None without CUDA)."""
    if not cumulative:
        return None
    return [now - before for before, now in zip([before_first, *cumulative[:-1]], cumulative, strict=True)]


def process_peaks() -> dict[str, Any]:
    """This rank's peaks as `StepMeasurement` keeps them: torch's allocator on the GPU (zeros without CUDA) and the
    process's resident memory."""
    cuda = torch.cuda.is_available()
    return dict(peak_gpu_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
                peak_gpu_reserved_gb=torch.cuda.max_memory_reserved() / 1e9 if cuda else 0.0,
                peak_gpu_active_gb=torch.cuda.memory_stats().get("active_bytes.all.peak", 0) / 1e9 if cuda else None,
                gpu_alloc_retries=alloc_retries(),
                host_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)


def reserved_by_stream() -> dict[str, dict[str, float]] | None:
    """The allocator's segments at this moment, summed per CUDA stream (handle 0 is the default stream): GB reserved
    and GB in live blocks. A block freed on one stream is cached for that stream only, so the streams' cached
    remainders add up; where their sum meets the GPU's size, allocations retry."""
    if not torch.cuda.is_available():
        return None
    streams: dict[str, dict[str, float]] = {}
    for segment in torch.cuda.memory_snapshot():
        entry = streams.setdefault(str(segment.get("stream", "?")), {"reserved_gb": 0.0, "allocated_gb": 0.0})
        entry["reserved_gb"] += segment["total_size"] / 1e9
        entry["allocated_gb"] += segment["allocated_size"] / 1e9
    return streams


def expandable_segments_in_use() -> bool | None:
    """Whether the CUDA allocator's segments are expandable, read from its snapshot (None without CUDA or segments):
    with them, reserved memory stays near allocated and "auto" has room for more state."""
    if not torch.cuda.is_available():
        return None
    segments = torch.cuda.memory_snapshot()
    return any(segment.get("is_expandable", False) for segment in segments) if segments else None
