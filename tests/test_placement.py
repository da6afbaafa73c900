"""Which units keep their optimizer state on the accelerator: the planning rules, against hand computations."""

from __future__ import annotations

import pytest
import torch

from lightning_zoff.offload.layout import ParamSlot, UnitLayout
from lightning_zoff.offload.placement import (
    UnitCost,
    fewest_for_host,
    first_by_fraction,
    first_that_fit,
    initial_placement,
    margin_bytes,
    parse_accelerator_state,
    unit_costs,
)

COSTS = [UnitCost("embed", 10, 100, 200), UnitCost("h.0", 20, 200, 400), UnitCost("h.1", 30, 300, 600),
         UnitCost("head", 40, 400, 800)]


@pytest.mark.parametrize(("value", "parsed"), [("auto", "auto"), (" AUTO ", "auto"), ("none", "none"), (0, "none"),
                                          (0.0, "none"), ("0.5", 0.5), (1, 1.0), (0.25, 0.25)])
def test_parse_accelerator_state(value, parsed):
    assert parse_accelerator_state(value) == parsed


@pytest.mark.parametrize("value", [1.5, -0.1, "half", True, None])
def test_parse_accelerator_state_refuses(value):
    with pytest.raises(ValueError, match="choose 'auto', 'none' or a fraction of the optimizer state between 0 and 1"):
        parse_accelerator_state(value)


def test_fraction_takes_the_first_units_within_the_share():
    # 100 trained elements in all: 0.3 covers embed + h.0 (30) exactly, 0.29 only embed, 0.6 the first three
    assert first_by_fraction(COSTS, 0.3) == ["embed", "h.0"]
    assert first_by_fraction(COSTS, 0.29) == ["embed"]
    assert first_by_fraction(COSTS, 0.6) == ["embed", "h.0", "h.1"]
    assert first_by_fraction(COSTS, 1.0) == ["embed", "h.0", "h.1", "head"]
    assert first_by_fraction(COSTS, 0.05) == []


def test_first_that_fit_stops_at_the_first_that_does_not():
    assert first_that_fit(COSTS, 299) == ["embed"]
    assert first_that_fit(COSTS, 300) == ["embed", "h.0"]
    assert first_that_fit(COSTS, 10_000) == ["embed", "h.0", "h.1", "head"]
    assert first_that_fit(COSTS, 99) == []


def test_fewest_for_host_moves_the_first_units_until_the_rest_fit():
    # 2000 bytes on the host in all
    assert fewest_for_host(COSTS, 2000) == []
    assert fewest_for_host(COSTS, 1800) == ["embed"]
    assert fewest_for_host(COSTS, 1799) == ["embed", "h.0"]
    assert fewest_for_host(COSTS, 0) == ["embed", "h.0", "h.1", "head"]


def test_initial_placement():
    assert initial_placement(COSTS, "none", accelerator_is_cpu=False, host_capacity=10) == []
    assert initial_placement(COSTS, 0.3, accelerator_is_cpu=True, host_capacity=None) == ["embed", "h.0"]
    assert initial_placement(COSTS, "auto", accelerator_is_cpu=True, host_capacity=10) == []  # nothing to gain
    assert initial_placement(COSTS, "auto", accelerator_is_cpu=False, host_capacity=1800) == ["embed"]
    assert initial_placement(COSTS, "auto", accelerator_is_cpu=False, host_capacity=None) == []


def test_margin():
    assert margin_bytes(16 * 2**30) == 2 * 2**30
    assert margin_bytes(140 * 2**30) == int(0.05 * 140 * 2**30)


def test_unit_costs_by_hand():
    trained, untrained, frozen = torch.zeros(6), torch.zeros(4), torch.zeros(3)
    layout = UnitLayout("h.0", (ParamSlot(trained, 0, 6, 6), ParamSlot(untrained, 6, 4, 4)), 10, (frozen,))
    group_of = {id(trained): 0}
    (bf16,) = unit_costs([layout], group_of, param_bytes=2, moment_bytes=4, second_moment=True, overlap=True,
                         accum_bytes=4)
    # accelerator: state 6 x (4 + 4 + 4) + grad staging 10 x 2 + param staging 6 x 2 + window sum 10 x 4
    assert bf16 == UnitCost("h.0", 6, 6 * 12 + 10 * 2 + 6 * 2 + 10 * 4, bf16.host_bytes)
    # host: state 6 x 12 and the spare pool's 1 B each, param staging 6 x 2, grad staging 10 x 2, window sum 10 x 4
    assert bf16.host_bytes == 6 * 13 + 6 * 2 + 10 * 2 + 10 * 4
    (lion_fp32,) = unit_costs([layout], group_of, param_bytes=4, moment_bytes=2, second_moment=False, overlap=False,
                              accum_bytes=0)
    # fp32 parameters leave from the master itself: no param staging
    assert lion_fp32 == UnitCost("h.0", 6, 6 * 6 + 10 * 4, 6 * 6 + 10 * 4)


def _unit_on_the_host():
    from lightning_zoff.offload.unit_state import Placement, build_unit_state

    params = [torch.zeros(6), torch.zeros(4)]
    layout = UnitLayout("h.0", (ParamSlot(params[0], 0, 6, 6), ParamSlot(params[1], 6, 4, 4)), 10, ())
    masters = {id(params[0]): torch.arange(6.0), id(params[1]): torch.arange(4.0) + 10}
    unit = build_unit_state(layout, masters, {id(params[0]): 0, id(params[1]): 0}, placement=Placement.HOST,
                            device=torch.device("cpu"), moments=2, moment_dtype=torch.float32,
                            sums_windows=True, grad_sum_dtype=torch.float32, pin=False)
    unit.state[1].normal_()
    unit.state[2].uniform_()
    return unit


def test_relocate_copies_the_state_exactly():
    from lightning_zoff.offload.unit_state import Placement, relocate

    unit = _unit_on_the_host()
    before = [t.clone() for t in unit.state]
    relocate(unit, Placement.ACCELERATOR, torch.device("cpu"), grad_sum_dtype=torch.float32, pin=False)
    assert unit.placement is Placement.ACCELERATOR
    assert all(torch.equal(a, b) for a, b in zip(unit.state, before, strict=True))
    assert unit.grad_sum is not None  # windows of several micro-batches still need their sum
    assert torch.equal(unit.grad_sum, torch.zeros(10))
    assert unit.fp32_params  # fp32 parameters leave from the master itself


def test_relocate_that_runs_out_of_memory_changes_nothing(monkeypatch):
    from lightning_zoff.offload import unit_state
    from lightning_zoff.offload.unit_state import Placement, relocate

    unit = _unit_on_the_host()
    state, grad_sum = unit.state, unit.grad_sum

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(unit_state, "_make_buffers", no_memory)
    with pytest.raises(torch.OutOfMemoryError):
        relocate(unit, Placement.ACCELERATOR, torch.device("cpu"), grad_sum_dtype=torch.float32, pin=False)
    assert unit.placement is Placement.HOST
    assert unit.state is state
    assert unit.grad_sum is grad_sum
