"""One pinned host buffer that host units' reduced shards land in and their updated 16-bit parameters leave from, in
turn, where windows sum on the host (`StateOptions.landing_ring`). A landed shard is needed only until the worker has
added it into the unit's fp32 `grad_sum`, and the 16-bit copy only until it went up, so a few units' worth of room
serves them all instead of 2 B per parameter (MegaTrain's Qwen2.5-7B configuration, 18 micro-batches a step: 11.3 GB
of the host's 106 GB, which held more of the state the GPU otherwise keeps beside the activations).

Room is taken in order around the buffer. Slots are given back in any order, but room is reused in the order it was
taken: behind the oldest slot still held, nothing is reused. A slot is free once released and, where it was released
after an event (a copy to the accelerator reading it), once that event completed. A taker waits while the
ring is full: the training thread in backward when the worker lags more than the ring holds (the step would wait for
those landings anyway), the worker when a 16-bit copy is still going up."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch

from lightning_zoff.placement.host_buffers import host_empty

_ALIGN = 64  # bytes: every slot starts on a cache line, so any dtype's view of it is aligned


@dataclass(eq=False)
class Slot:
    start: int
    end: int
    released: bool = False
    after: torch.cuda.Event | None = None  # released, but busy until this completes

    def free(self) -> bool:
        return self.released and (self.after is None or self.after.query())


class StagingRing:
    """`nbytes` of host memory (pinned if `pin`), handed out as slots by `take` and back by `release`."""

    def __init__(self, nbytes: int, device: torch.device, pin: bool) -> None:
        self.device, self.pin = device, pin
        self.buffer = host_empty(nbytes, torch.uint8, device, pin)
        self._slots: deque[Slot] = deque()  # taken and not yet reclaimed, in the order taken
        self._changed = threading.Condition()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Slot]:
        """A flat tensor of `numel` elements of `dtype` in the ring and its slot (for `release`); waits for room."""
        nbytes = numel * dtype.itemsize
        if nbytes > self.nbytes:
            raise RuntimeError(f"zoff: a staging slot of {nbytes} bytes asked of a ring of {self.nbytes}")
        with self._changed:
            while (start := self._room(nbytes)) is None:
                oldest = self._slots[0]
                if oldest.released and oldest.after is not None:
                    oldest.after.synchronize()  # a copy up still reads it
                else:
                    self._changed.wait()
            slot = Slot(start, start + nbytes)
            self._slots.append(slot)
        return self.buffer[slot.start : slot.end].view(dtype), slot

    def release(self, slot: Slot, after: torch.cuda.Event | None = None) -> None:
        """Give the slot back, for reuse once `after` (if any) has completed."""
        with self._changed:
            slot.after, slot.released = after, True
            self._changed.notify_all()

    def resize(self, nbytes: int) -> None:
        """Make the buffer `nbytes` (between steps: nothing taken is in use any more)."""
        with self._changed:
            for slot in self._slots:
                assert slot.released, "the staging ring resized while a slot is taken"
                if slot.after is not None:
                    slot.after.synchronize()
            self._slots.clear()
            if nbytes != self.nbytes:
                self.buffer = host_empty(0, torch.uint8, self.device, self.pin)  # the old one goes first
                self.buffer = host_empty(nbytes, torch.uint8, self.device, self.pin)

    def _room(self, nbytes: int) -> int | None:
        """Where a slot of `nbytes` starts, after reclaiming the free slots at the ring's tail; None: no room yet."""
        while self._slots and self._slots[0].free():
            self._slots.popleft()
        if not self._slots:
            return 0
        tail, head = self._slots[0].start, _aligned(self._slots[-1].end)
        if self._slots[-1].start >= tail:  # taken room runs from the tail to the head: after it, or from the start
            if head + nbytes <= self.nbytes:
                return head
            return 0 if nbytes <= tail else None
        return head if head + nbytes <= tail else None  # wrapped: the room lies between head and tail


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN
