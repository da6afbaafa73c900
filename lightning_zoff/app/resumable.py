"""A DataLoader that a run resumed from a mid-epoch checkpoint continues where the checkpoint left it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader
from typing_extensions import override


class ResumableLoader(DataLoader):
    """Lightning saves the `state_dict` of a training loader that has one and, resuming, loads it before the epoch
    starts again; without one a resumed epoch starts over from its first batch. This loader counts the batches it has
    given in the current epoch, and after `load_state_dict` it draws that many and drops them: the sampler (which
    Lightning seeds by the epoch) then yields exactly what the uninterrupted run saw next."""

    _given = 0
    _resume: dict[str, Any] | None = None  # the state of a checkpoint, until the pass it was saved in starts again

    @override
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # only in the epoch the checkpoint was saved in: a later epoch starts from its first batch
        epoch = getattr(self.sampler, "epoch", None)  # a DistributedSampler's, set by Lightning every epoch
        resume, self._resume, self._given = self._resume, None, 0
        skip = resume["batches"] if resume is not None and resume["epoch"] == epoch else 0
        for batch in super().__iter__():
            self._given += 1
            if self._given > skip:
                yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self._given, "epoch": getattr(self.sampler, "epoch", None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = dict(state) if state["batches"] < len(self) else None
