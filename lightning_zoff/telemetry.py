"""Per-step breakdown: forward, backward, exposed optimizer time, CPU update time, bytes over PCIe."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class StepTimer:
    """Seconds per phase, summed over an accumulation window.

    On CUDA a phase is timed by two events on the current stream: the time the accelerator took from reaching the
    phase's start to reaching its end, which includes the time it sat idle waiting for the host (a forward held by
    an update, the step's decision). The events are read once they are done, so a window's times come out a step
    or two late and timing never makes the host wait for the accelerator (a synchronize per phase would stall the
    very overlap it measures). Elsewhere, wall-clock time, at once.

    The time from one phase's end to the next one's start, in the window of the later, is the phase "between": what
    the accelerator spent outside every phase (the loop's own work between micro-batches, a batch's copy, the host
    late with the next forward), from the same events, none added.

    "first_forward" is the window's first forward alone (also in "forward"): the one that meets the last step's
    updates, so a step whose later micro-batches are no slower shows where its forward time went."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._window: dict[str, list] = defaultdict(list)  # phase -> [(start, end)] events, or seconds off CUDA
        self._pending: list[tuple[dict[str, list], dict[str, float]]] = []  # closed windows not yet read
        self._last_end: Any = None  # the last phase's end: its event, or perf_counter's seconds off CUDA

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        if self.device.type != "cuda":
            started = time.perf_counter()
            if self._last_end is not None:
                self._window["between"].append(started - self._last_end)
            try:
                yield
            finally:
                self._last_end = time.perf_counter()
                self._window[phase].append(self._last_end - started)
            return
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(self.device))
        if self._last_end is not None:
            self._window["between"].append((self._last_end, start))
        try:
            yield
        finally:
            end = self._last_end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            self._window[phase].append((start, end))

    def end_window(self, **extra: float) -> dict[str, float] | None:
        """Close the window (`extra`: seconds measured elsewhere that belong to it) and return the oldest closed
        window whose times are known, with its extras; None while none is."""
        self._pending.append((dict(self._window), extra))
        self._window = defaultdict(list)
        if not self._done(self._pending[0][0]):
            return None
        window, extra = self._pending.pop(0)  # one per call: every window is reported once, in order
        times = {phase: sum(self._seconds(t) for t in timings) for phase, timings in window.items()}
        if window.get("forward"):
            times["first_forward"] = self._seconds(window["forward"][0])
        return {**times, **extra}

    @staticmethod
    def _done(window: dict[str, list]) -> bool:
        return all(not isinstance(t, tuple) or t[1].query() for timings in window.values() for t in timings)

    @staticmethod
    def _seconds(timing: float | tuple[torch.cuda.Event, torch.cuda.Event]) -> float:
        if isinstance(timing, tuple):
            return timing[0].elapsed_time(timing[1]) / 1000.0
        return timing


def step_metrics(times: dict[str, float] | None, traffic: Any, grad_norm: float, skipped: bool,
                 loss_scale: float) -> dict[str, float]:
    """What zoff logs for an optimizer step: the phase times of a window (`StepTimer.end_window`, None while not known
    yet, its `gate_wait` among them) and the engine's `traffic` since the last step."""
    metrics = {}
    if times is not None:
        # forwards that waited for an overlapped update: that wait is exposed optimizer time, not forward time
        gate_wait = times.pop("gate_wait")
        times["forward"] = times.get("forward", 0.0) - gate_wait
        if "first_forward" in times:  # the gate holds the window's first forward only
            times["first_forward"] -= gate_wait
        times["exposed_optimizer"] = times.get("exposed_optimizer", 0.0) + gate_wait
        metrics = {f"zoff/{phase}_s": seconds for phase, seconds in times.items()}
    return metrics | {
        # cpu_update_s: update kernels that finished since the last step (overlapped ones may end a step late)
        "zoff/cpu_update_s": traffic.cpu_update_s, "zoff/d2h_gb": traffic.d2h_bytes / 1e9,
        "zoff/h2d_gb": traffic.h2d_bytes / 1e9, "zoff/grad_norm": grad_norm,
        "zoff/skipped": float(skipped), "zoff/loss_scale": loss_scale,
        "zoff/speculations_kept": float(traffic.speculations_kept),
        "zoff/speculations_redone": float(traffic.speculations_redone),
        "zoff/lent_units": float(traffic.lent_units),  # host units the accelerator updated, and their elements
        "zoff/lent_elements": float(traffic.lent_elements),
        "zoff/landing_wait_s": traffic.landing_wait_s,  # backward waiting for the host's sums (`landing.py`)
    }
