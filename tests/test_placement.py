"""Which units keep their optimizer state on the accelerator: the placement rules, against hand computations; and a
unit's move between placements."""

from __future__ import annotations

import pytest
import torch

from lightning_zoff.config import parse_accelerator_state
from lightning_zoff.offload.layout import ParamSlot, UnitLayout
from lightning_zoff.placement import UnitShape, margin_bytes
from lightning_zoff.placement.policy import fewest_for_host, first_by_fraction, first_that_fit

UNITS = [UnitShape("embed", 10, 10, True), UnitShape("h.0", 20, 20, True), UnitShape("h.1", 30, 30, True),
         UnitShape("head", 40, 40, True)]
ACCELERATOR_BYTES = {"embed": 100, "h.0": 200, "h.1": 300, "head": 400}
HOST_BYTES = {"embed": 200, "h.0": 400, "h.1": 600, "head": 800}


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
    assert first_by_fraction(UNITS, 0.3) == ["embed", "h.0"]
    assert first_by_fraction(UNITS, 0.29) == ["embed"]
    assert first_by_fraction(UNITS, 0.6) == ["embed", "h.0", "h.1"]
    assert first_by_fraction(UNITS, 1.0) == ["embed", "h.0", "h.1", "head"]
    assert first_by_fraction(UNITS, 0.05) == []


def test_first_that_fit_stops_at_the_first_that_does_not():
    assert first_that_fit(UNITS, ACCELERATOR_BYTES, 299) == ["embed"]
    assert first_that_fit(UNITS, ACCELERATOR_BYTES, 300) == ["embed", "h.0"]
    assert first_that_fit(UNITS, ACCELERATOR_BYTES, 10_000) == ["embed", "h.0", "h.1", "head"]
    assert first_that_fit(UNITS, ACCELERATOR_BYTES, 99) == []


def test_fewest_for_host_moves_the_first_units_until_the_rest_fit():
    # 2000 bytes on the host in all
    assert fewest_for_host(UNITS, HOST_BYTES, 2000) == []
    assert fewest_for_host(UNITS, HOST_BYTES, 1800) == ["embed"]
    assert fewest_for_host(UNITS, HOST_BYTES, 1799) == ["embed", "h.0"]
    assert fewest_for_host(UNITS, HOST_BYTES, 0) == ["embed", "h.0", "h.1", "head"]


def test_margin():
    assert margin_bytes(16 * 2**30) == 2 * 2**30
    assert margin_bytes(140 * 2**30) == int(0.05 * 140 * 2**30)


def _unit_on_the_host():
    from lightning_zoff.offload.unit_state import build_unit_state
    from lightning_zoff.placement import Placement

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
    from lightning_zoff.placement import Placement
    from lightning_zoff.placement.mover import relocate

    unit = _unit_on_the_host()
    before = [t.clone() for t in unit.state]
    relocate(unit, Placement.ACCELERATOR, torch.device("cpu"), grad_sum_dtype=torch.float32, pin=False)
    assert unit.placement is Placement.ACCELERATOR
    assert all(torch.equal(a, b) for a, b in zip(unit.state, before, strict=True))
    assert unit.grad_sum is not None  # windows of several micro-batches still need their sum
    assert torch.equal(unit.grad_sum, torch.zeros(10))
    assert unit.fp32_params  # fp32 parameters leave from the master itself
    assert unit.grad_staging is None  # FSDP2's reduced shard is held on the accelerator
    assert unit.param_staging is None  # and the update writes FSDP2's shards


def test_relocate_that_runs_out_of_memory_changes_nothing(monkeypatch):
    from lightning_zoff.placement import Placement, mover
    from lightning_zoff.placement.mover import relocate

    unit = _unit_on_the_host()
    state, grad_sum = unit.state, unit.grad_sum

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(mover, "make_buffers", no_memory)
    with pytest.raises(torch.OutOfMemoryError):
        relocate(unit, Placement.ACCELERATOR, torch.device("cpu"), grad_sum_dtype=torch.float32, pin=False)
    assert unit.placement is Placement.HOST
    assert unit.state is state
    assert unit.grad_sum is grad_sum


@pytest.mark.slow
def test_a_unit_moved_away_gives_its_host_memory_back_to_the_os():
    import gc

    import psutil

    from lightning_zoff.offload.unit_state import build_unit_state
    from lightning_zoff.placement import Placement
    from lightning_zoff.placement.mover import relocate

    n = 2**24  # one bf16 parameter: its state 16 M x 12 B, its gradient's landing buffer 16 M x 2 B
    param = torch.zeros(n, dtype=torch.bfloat16)
    layout = UnitLayout("h.0", (ParamSlot(param, 0, n, n),), n, ())
    unit = build_unit_state(layout, {id(param): torch.ones(n)}, {id(param): 0}, placement=Placement.HOST,
                            device=torch.device("cpu"), moments=2, moment_dtype=torch.float32, sums_windows=False,
                            grad_sum_dtype=torch.float32, pin=False)
    assert unit.grad_staging is not None
    unit.grad_staging.fill_(1)  # resident, as after a backward
    assert unit.param_staging is not None
    assert unit.param_staging.data_ptr() == unit.grad_staging.data_ptr()  # parameters leave from the gradient bytes
    process = psutil.Process()
    gc.collect()
    before = process.memory_info().rss
    # the meta device stands in for an accelerator: the state leaves the host whole and nothing stays behind
    relocate(unit, Placement.ACCELERATOR, torch.device("meta"), grad_sum_dtype=torch.float32, pin=False)
    gc.collect()
    returned = before - process.memory_info().rss
    assert returned >= 0.95 * n * (12 + 2), f"{returned / 2**20:.0f} MiB of {n * 14 / 2**20:.0f} MiB returned"
