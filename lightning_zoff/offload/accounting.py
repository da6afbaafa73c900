"""What the engine moved and spent: per-step traffic counters."""

from __future__ import annotations

import threading

_COUNTERS = ("d2h_bytes", "h2d_bytes", "cpu_update_s", "speculations_kept", "speculations_redone", "lent_units",
             "lent_elements", "landing_wait_s")


class Traffic:
    """What the optimizer steps moved and cost on the host side since the last `take_traffic`."""

    def __init__(self) -> None:
        self.d2h_bytes = self.h2d_bytes = 0
        self.cpu_update_s = 0.0  # update kernels, speculative ones included
        self.speculations_kept = self.speculations_redone = 0
        self.lent_units = self.lent_elements = 0  # host units whose update the accelerator ran (`lending.py`)
        # backward's waits for room to land a shard: the staging ring full, or a unit's last shard not yet summed
        self.landing_wait_s = 0.0
        self._lock = threading.Lock()  # the worker and the training thread both count

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def take(self) -> Traffic:
        """The counts so far, and zero from here on: under the lock the worker's `add` takes, so no count is lost."""
        taken = Traffic()
        with self._lock:
            for name in _COUNTERS:
                setattr(taken, name, getattr(self, name))
                setattr(self, name, 0)
        return taken

