"""Which host units' updates the accelerator runs this step (`lending.py` runs them): the split of the host's work
between its cores and the accelerator, so that both finish the units the next forward needs as early as they can.

Both sides work through their units in forward order, at their own speed in seconds per element: the host's kernels,
and the accelerator's pieces going up, updated and coming back. Each unit, in forward order, goes to the side that
would finish it first, so the two run side by side and the forward meets few units not yet done. With "auto" the
speeds are measured (the first replaces the guess, each later one is averaged with the last: the host's slows while PCIe
streams beside it, so each is measured while the other works); until then, they start from the bytes each moves over a
conservative bandwidth.
A fraction asks for that share of the elements instead: the speeds are then set so the split gives it.
"""

from __future__ import annotations

from collections.abc import Sequence

# first guesses, until a step measured each side: the host's kernels stream ~90 GB/s; a lent element's bytes go up at
# ~25 GB/s (PCIe gen4 x16 or better; the bytes back travel the other way at the same time)
_HOST_BYTES_PER_S = 90e9
_UP_BYTES_PER_S = 25e9


class UpdateSplit:
    """`share`: "auto" or a fraction in (0, 1] of the host's elements; `host_bytes` and `up_bytes`: what updating one
    element moves on the host (read and written) and up to the accelerator."""

    def __init__(self, share: str | float, *, host_bytes: int, up_bytes: int) -> None:
        self.share = share
        self._guessed = {"host": True, "lent": True}  # a first measurement replaces the guess, later ones average
        if isinstance(share, float):  # speeds in the ratio of the share asked for
            self.host_s, self.lent_s = share, 1.0 - share
        else:
            self.host_s, self.lent_s = host_bytes / _HOST_BYTES_PER_S, up_bytes / _UP_BYTES_PER_S

    def choose(self, units: Sequence[tuple[str, int]]) -> set[str]:
        """The names of the units (`(name, elements)` in forward order) whose updates the accelerator runs."""
        host_done = lent_done = 0.0
        lent = set()
        for name, elements in units:
            if lent_done + elements * self.lent_s < host_done + elements * self.host_s:
                lent_done += elements * self.lent_s
                lent.add(name)
            else:
                host_done += elements * self.host_s
        return lent

    def observed(self, *, host: tuple[float, int] | None = None, lent: tuple[float, int] | None = None) -> None:
        """A step's measured speeds, as (seconds per element, elements); "auto" only (a fraction keeps its split)."""
        if isinstance(self.share, float):
            return
        if host is not None and host[1]:
            self.host_s = host[0] if self._guessed["host"] else (self.host_s + host[0]) / 2
            self._guessed["host"] = False
        if lent is not None and lent[1]:
            self.lent_s = lent[0] if self._guessed["lent"] else (self.lent_s + lent[0]) / 2
            self._guessed["lent"] = False
