"""The landing's bound on reduced shards waiting for their copy (`offload/landing.py`): FSDP2 frees a shard's memory for
reuse only once the copy stream passed it, so the thread running backward waits for the oldest copies beyond
`REDUCED_IN_FLIGHT`, in the order they were queued; the plan counts that many (`test_step_memory.py`)."""

from __future__ import annotations

import torch

from lightning_zoff.offload.accounting import Traffic
from lightning_zoff.offload.landing import GradientLanding, LandingOptions
from lightning_zoff.placement.plan import REDUCED_IN_FLIGHT


class Copy:
    """A copy's end as a CUDA event marks it: waiting for it is logged."""

    def __init__(self, waited: list[int], index: int) -> None:
        self.waited, self.index = waited, index

    def synchronize(self) -> None:
        self.waited.append(self.index)


def landing() -> GradientLanding:
    options = LandingOptions(grad_sum_dtype=torch.float32, pin_memory=False, accumulate_on_accelerator=False,
                             retain_device_sum=False, threads=None)
    return GradientLanding([], options, Traffic(), None, None, param_device=torch.device("cpu"),
                           copy_stream=None, compute_stream=None)


def test_backward_waits_for_the_oldest_copies_beyond_the_bound():
    land, waited = landing(), []
    for index in range(5):
        land._bound_copies_in_flight(Copy(waited, index))
        assert len(land.copies_in_flight) == min(index + 1, REDUCED_IN_FLIGHT)
    assert REDUCED_IN_FLIGHT == 2
    assert waited == [0, 1, 2]  # five queued, the last two may still be copying
    land._bound_copies_in_flight(None)  # a CPU copy ended when it was made: nothing to wait for
    assert waited == [0, 1, 2]


def test_a_new_backward_starts_with_no_copy_in_flight():
    land, waited = landing(), []
    for index in range(2):
        land._bound_copies_in_flight(Copy(waited, index))
    land.begin_backward(window_ends=True, loss_scale=1.0)  # the last step read every copy of its backward
    land._bound_copies_in_flight(Copy(waited, 2))
    assert waited == []
    assert len(land.copies_in_flight) == 1
