"""Per-step breakdown: forward, backward, exposed optimizer time, CPU update time, bytes over PCIe."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class StepTimer:
    """Wall-clock seconds per phase, summed over an accumulation window. On CUDA each phase ends with a
    synchronize, so the GPU work of a phase is charged to it and not to the next one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.window: dict[str, float] = defaultdict(float)

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.window[phase] += time.perf_counter() - start

    def take(self) -> dict[str, float]:
        window, self.window = dict(self.window), defaultdict(float)
        return window
