"""The memory plan against hand computations: each unit's bytes per side, the spare sets, placement by the machine's
memory, the refusal of what cannot fit, and the moves a measured peak asks for."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_zoff.placement import Machine, Placement, PlanDoesNotFit, StateOptions, UnitShape, plan_memory
from lightning_zoff.placement.machine import GB, HOST_RESERVE
from lightning_zoff.placement.plan import host_bytes_per_element, ring_bytes, unit_buffers
from lightning_zoff.placement.policy import fewer_for_accelerator, more_for_accelerator
from lightning_zoff.placement.rank import held_peak

BF16_ADAM = StateOptions(param_bytes=2, moment_bytes=4, moments=2, sum_bytes=0)
HOST, ACCEL = Placement.HOST, Placement.ACCELERATOR


def test_a_units_bytes_by_hand():
    shape = UnitShape("h.0", trained=6, reduced=10, same_layout=False)  # 4 reduced elements the optimizer leaves out
    # host: master 6 x 4, moments 6 x 8, the reduced shard lands in 10 x 2, the 16-bit parameters leave from 6 x 2
    assert unit_buffers(shape, BF16_ADAM, HOST) == {"master": 24, "moments": 48, "grad_sum": 0, "grad_landing": 20,
                                                   "param_out": 12}
    # where the layouts agree, the parameters leave from the landing buffer itself
    same = UnitShape("h.1", trained=10, reduced=10, same_layout=True)
    assert unit_buffers(same, BF16_ADAM, HOST)["param_out"] == 0
    # accelerator: state only; FSDP2's reduced shard is held, FSDP2's shards take the parameters
    assert unit_buffers(shape, BF16_ADAM, ACCEL) == {"master": 24, "moments": 48, "grad_sum": 0}
    # a window sum of fp32 on either side, Lion's one bf16 moment, 32-true's 4-byte landing and no out buffer
    # (without overlap: with it, the host units land in the shared staging ring instead)
    lion = StateOptions(param_bytes=4, moment_bytes=2, moments=1, sum_bytes=4, speculates=False)
    assert unit_buffers(shape, lion, HOST) == {"master": 24, "moments": 12, "grad_sum": 40, "grad_landing": 40,
                                               "param_out": 0}
    assert unit_buffers(shape, lion, ACCEL) == {"master": 24, "moments": 12, "grad_sum": 40}
    ringed = StateOptions(param_bytes=4, moment_bytes=2, moments=1, sum_bytes=4)
    assert unit_buffers(shape, ringed, HOST) == {"master": 24, "moments": 12, "grad_sum": 40}


def test_the_staging_ring_by_hand():
    """Where windows sum on the host with overlap, the host units share a ring of `ring_units` (3) of the largest unit's
    landing or 16-bit copy, never more than their own buffers would have taken."""
    options = StateOptions(param_bytes=2, moment_bytes=4, moments=2, sum_bytes=4)
    assert options.landing_ring
    units = [UnitShape("a", 100, 100, True), UnitShape("b", 60, 100, False)]
    units += [UnitShape(f"c.{i}", 500, 500, True) for i in range(4)]
    assert ring_bytes(units, options) == 3 * 2 * 500  # a c's landing: 1000 B
    # a, b and one c: their own landings (200, 200, 1000) and b's out (120) are less than 3 x 1000
    assert ring_bytes(units[:3], options) == 200 + 200 + 120 + 1000
    assert ring_bytes([], options) == 0
    # no ring: windows of one micro-batch (the landing holds the gradient until the step), without overlap, with
    # the window's sum on the accelerator, or `staging_ring_units=0`
    assert ring_bytes(units, replace(options, ring_units=2)) == 2 * 2 * 500
    for other in (replace(options, sum_bytes=0), replace(options, speculates=False),
                  replace(options, sum_on_accelerator=True), replace(options, ring_units=0)):
        assert not other.landing_ring
        assert ring_bytes(units, other) == 0
    # the plan holds it on the host beside the units' own buffers: 6 host units of 1B elements
    plan = plan_memory(BLOCKS, options, machine(1000), "none", model_bytes=0)
    assert plan.ring_bytes == 3 * 2 * 10**9
    assert plan.host_bytes == 6 * 16 * 10**9 + plan.spare_sets * 14 * 10**9 + plan.ring_bytes
    assert plan.report()["host_staging"] == plan.ring_bytes


@pytest.mark.parametrize(("options", "per_element"), [
    (BF16_ADAM, 14),  # 12 of state, 2 of gradient (the parameters go back from the same bytes)
    (StateOptions(param_bytes=2, moment_bytes=2, moments=2, sum_bytes=0), 10),  # bf16 moments
    # an fp32 window sum; with overlap the gradient lands in the shared staging ring, not in 2 B of its own
    (StateOptions(param_bytes=2, moment_bytes=4, moments=2, sum_bytes=4, speculates=False), 18),
    (StateOptions(param_bytes=2, moment_bytes=4, moments=2, sum_bytes=4), 16),
    (StateOptions(param_bytes=2, moment_bytes=4, moments=2, sum_bytes=2), 14),  # a bf16 window sum
    (StateOptions(param_bytes=4, moment_bytes=4, moments=2, sum_bytes=0), 16),  # 32-true: a 4-byte gradient
    (StateOptions(param_bytes=2, moment_bytes=4, moments=1, sum_bytes=0), 10),  # Lion
])
def test_host_bytes_per_element(options, per_element):
    assert host_bytes_per_element(options) == per_element


def machine(host_gb: float, accelerator_gb: float | None = None) -> Machine:
    # a share HOST_RESERVE of what is available stays with the process: host_gb is what the plan may use
    return Machine(int(host_gb * GB / (1 - HOST_RESERVE)) + 1,
                   None if accelerator_gb is None else int(accelerator_gb * GB))


BLOCKS = [UnitShape(f"h.{i}", 10**9, 10**9, True) for i in range(6)]  # 1B elements each: 14 GB on the host


def test_spare_sets_take_the_hosts_room_at_most_one_per_two_units():
    # each set: a unit's state (12 GB) and its 16-bit copy (2 GB)
    plenty = plan_memory(BLOCKS, BF16_ADAM, machine(1000), "none", model_bytes=0)
    assert plenty.host_bytes == 6 * 14 * 10**9 + plenty.spare_sets * 14 * 10**9
    assert plenty.spare_sets == 3  # one per two host units
    tight = plan_memory(BLOCKS, BF16_ADAM, machine(6 * 14 + 14 + 13), "none", model_bytes=0)
    assert tight.spare_sets == 1  # 27 GB left: one set
    none_left = plan_memory(BLOCKS, BF16_ADAM, machine(6 * 14 + 13), "none", model_bytes=0)
    assert none_left.spare_sets == 0  # the units fit, no set does: nothing speculates
    sync = plan_memory(BLOCKS, StateOptions(2, 4, 2, 0, speculates=False), machine(1000), "none", model_bytes=0)
    assert sync.spare_sets == 0


def test_auto_puts_on_a_gpu_only_the_first_units_the_host_cannot_hold():
    # 4 units (56 GB) and one unit's fp32 copy while its state is built (4 GB) fit a 60 GB host
    plan = plan_memory(BLOCKS, BF16_ADAM, machine(60, 100), "auto", model_bytes=10 * 10**9)
    assert [s.name for s in plan.units_on(ACCEL)] == ["h.0", "h.1"]  # the forward needs them first
    assert plan.state_on(ACCEL) == 2 * 12 * 10**9
    # on a CPU accelerator "auto" keeps everything on the host; a fraction is the first units up to that share
    assert not plan_memory(BLOCKS, BF16_ADAM, machine(1000), "auto", model_bytes=0).units_on(ACCEL)
    half = plan_memory(BLOCKS, BF16_ADAM, machine(1000), 0.5, model_bytes=0)
    assert [s.name for s in half.units_on(ACCEL)] == ["h.0", "h.1", "h.2"]


def test_what_cannot_fit_is_refused_with_the_numbers_and_what_would_fit():
    # 6 units on a 60 GB host and a 40 GB GPU, half the state on the GPU: 3 x 14 on the host fits, 3 x 12 + the
    # update's workspace (0.27) + the model's 10 + the margin (2 GiB) does not fit the GPU; "auto" puts 2 units there
    with pytest.raises(PlanDoesNotFit, match=(
            r"does not fit the accelerator \(48\.4 GB needed before activations: model 10\.0 GB, optimizer state 36\.3"
            r" GB, margin 2\.1 GB; 40\.0 GB usable\) .* Options that fit \(checked by the plan\):"
            r" optimizer_state_dtype='bf16' \(moments in 2 bytes each\): fits with .* to spare on the host and .* on"
            r" the accelerator before activations; accelerator_state='auto': fits with")):
        plan_memory(BLOCKS, BF16_ADAM, machine(60, 40), 0.5, model_bytes=10 * 10**9)
    # all on the host: 84 GB and one unit's fp32 copy while its state is built, on a 60 GB host
    with pytest.raises(PlanDoesNotFit, match=r"does not fit the host \(88\.0 GB needed, 60\.0 GB usable\).*"
                                             r"Options that fit \(checked by the plan\): accelerator_state='auto'"
                                             # the host holds 4 units (56 GB) and a unit's fp32 copy (4 GB): 0 left;
                                             # the GPU 200 less the model 10, 2 x 12, the workspace 0.27, the margin 10
                                             r": fits with 0\.0 MB to spare on the host and 155\.7 GB on the"):
        plan_memory(BLOCKS, BF16_ADAM, machine(60, 200), "none", model_bytes=10 * 10**9)
    # the fp32 copies the state is built from count too: 6 x 4 GB held while the first units' state is made
    with pytest.raises(PlanDoesNotFit, match="the host"):
        plan_memory(BLOCKS[:1], BF16_ADAM, machine(20), "none", model_bytes=0, masters_bytes=24 * 10**9)


def test_a_measured_peak_moves_the_hosts_first_units_there_and_back():
    plan = plan_memory(BLOCKS, BF16_ADAM, machine(1000, 100), "auto", model_bytes=10 * 10**9)
    assert not plan.units_on(ACCEL)
    margin = plan.machine.accelerator_margin  # 5 GB of 100
    # a step peaked at 50 GB: 45 GB left beside the margin take three units' state (12 GB each) and the update's
    # workspace (one piece of 2^26 fp32 elements)
    assert more_for_accelerator(plan, 50 * 10**9) == ["h.0", "h.1", "h.2"]
    moved = plan.moved(["h.0", "h.1", "h.2"], ACCEL)
    assert moved.accelerator_transient_bytes == 4 * 2**26
    assert moved.spare_sets == 1  # three host units left
    # the next step peaked within the margin's first half: nothing moves back; past it, the last units in forward
    # order go back until the whole margin is free
    assert fewer_for_accelerator(moved, 100 * 10**9 - margin // 2) == []
    assert fewer_for_accelerator(moved, 100 * 10**9 - margin // 4) == ["h.2"]
    assert fewer_for_accelerator(moved, 100 * 10**9 + 13 * 10**9) == ["h.2", "h.1"]


def test_the_measured_peak_counts_freed_blocks_another_stream_still_uses(monkeypatch):
    # torch's allocator stops counting a freed block as allocated at once, but reuses it only once the streams it was
    # recorded on (`record_stream`) passed it: the "active" peak counts it until then, and "auto" places by that
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 60 * 10**9)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"active_bytes.all.peak": 69 * 10**9})
    assert held_peak(torch.device("cuda")) == 69 * 10**9
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})  # a torch without the statistic
    assert held_peak(torch.device("cuda")) == 60 * 10**9
