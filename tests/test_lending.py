"""The accelerator runs a share of the host units' updates (`accelerator_update_share`, offload/lending.py): training
matches DDP, a run lending any share gives the bits of the host's kernels alone, the split is the one asked for, and the
slots are the plan's."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

import helpers.trainer
from helpers.compare import rel_err
from helpers.tiny import token_loader
from helpers.tiny_module import TinyModule, read_probe
from lightning_zoff import ZoffStatsMonitor, ZoffStrategy
from lightning_zoff.config import ZoffConfig
from lightning_zoff.offload.update_split import UpdateSplit
from lightning_zoff.optim.host_math import workspace_bytes
from lightning_zoff.placement import Machine, Placement, StateOptions, UnitShape, plan_memory
from lightning_zoff.placement.plan import LEND_PIECE, LEND_SLOTS


def fit(out, strategy, *, precision="32-true", accumulate=2, max_steps=8, clip=0.84):
    import lightning.pytorch as pl

    pl.seed_everything(7)
    module = TinyModule()
    helpers.trainer.fit(module, token_loader(batch_size=4), strategy, out=out, devices=2, precision=precision,
                        max_steps=max_steps, accumulate=accumulate, clip=clip, callbacks=[ZoffStatsMonitor()])
    return module


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_lent_updates_match_ddp(tmp_path, share):
    # 32-true, windows of two micro-batches (the fp32 window sum goes up), some steps clipped
    ddp, zoff = tmp_path / "ddp", tmp_path / "zoff"
    ddp.mkdir()
    zoff.mkdir()
    fit(ddp, DDPStrategy(start_method="fork"))
    fit(zoff, ZoffStrategy(start_method="fork", accelerator_state="none", accelerator_update_share=share))
    got, want = read_probe(zoff), read_probe(ddp)
    assert rel_err(got["losses"], want["losses"]) < 1e-5
    assert min(got["clip_coefs"]) < 1.0 == max(got["clip_coefs"])
    telemetry = got["telemetry"]
    assert telemetry["zoff/lent_units"] > 0  # the last step lent some of the four host units
    # what went up: each lent element's master and moments (12 B) and window sum (4 B); each of the host's own
    # elements its parameter (4 B in 32-true); both counted at the step's decision, so the last step's are its own
    lent = telemetry["zoff/lent_elements"]
    host = got["memory"]["trained_params"] - lent
    assert telemetry["zoff/h2d_gb"] * 1e9 == pytest.approx(lent * (12 + 4) + host * 4, rel=1e-6)
    assert got["placements"] == dict.fromkeys(got["placements"], "host")  # lent for a step, the state stays home
    assert got["held"]["lending"] == got["planned"]["lending"] == got["memory"]["accelerator_lending"] > 0


@pytest.mark.parametrize("share", [0.5, 1.0])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_lent_updates_give_the_host_kernels_bits(tmp_path, share, accumulate):
    # the accelerator computes a lent update with the host kernels' arithmetic (optim/host_math.py), so a run with any
    # share lent ends with the bits of one updated by the host alone: losses, masters (with overlap's speculation and
    # clipping on: a clipped step's factor comes from the same norm either way)
    lent, host = tmp_path / "lent", tmp_path / "host"
    lent.mkdir()
    host.mkdir()
    options = dict(start_method="fork", accelerator_state="none", weights_to_main_process=True)
    lent_module = fit(lent, ZoffStrategy(**options, accelerator_update_share=share), precision="bf16-true",
                      accumulate=accumulate)
    host_module = fit(host, ZoffStrategy(**options, accelerator_update_share="none"), precision="bf16-true",
                      accumulate=accumulate)
    assert read_probe(lent)["telemetry"]["zoff/lent_units"] > 0
    assert read_probe(host)["telemetry"]["zoff/lent_units"] == 0
    assert min(read_probe(host)["clip_coefs"]) < 1.0
    assert read_probe(lent)["losses"] == read_probe(host)["losses"]
    for a, b in zip(lent_module.state_dict().values(), host_module.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("share", "pinned"), [(0.5, True), ("none", False)])
def test_the_host_state_is_asked_pinned_at_setup_where_the_plan_lends(tmp_path, monkeypatch, share, pinned):
    # where the GPU takes a share, the host's masters and moments cross PCIe: they are pinned when made, not when first
    # lent (a step that lent a new unit waited for cudaHostRegister). Recorded from the forked ranks into a file.
    import lightning_zoff.offload.unit_state as unit_state

    made = tmp_path / "made.txt"
    real = unit_state.host_empty

    def recording(numel, dtype, device, pin):
        with made.open("a") as f:
            f.write(f"{pin}\n")
        return real(numel, dtype, device, pin)

    monkeypatch.setattr(unit_state, "host_empty", recording)
    fit(tmp_path, ZoffStrategy(start_method="fork", accelerator_state="none", accelerator_update_share=share),
        max_steps=1)
    asked = made.read_text().split()
    assert len(asked) == 2 * 3 * 4  # master and two moments of 4 units on each of 2 ranks
    assert set(asked) == {str(pinned)}


def test_no_share_without_pinned_memory(tmp_path):
    # the share streams the host's state: pageable memory would stop the worker at every piece, so none is planned
    fit(tmp_path, ZoffStrategy(start_method="fork", accelerator_state="none", accelerator_update_share=1.0,
                               pin_memory=False))
    got = read_probe(tmp_path)
    assert got["telemetry"]["zoff/lent_units"] == 0
    assert got["planned"]["lending"] == got["held"]["lending"] == 0


@pytest.mark.parametrize("option", [dict(optimizer_state_dtype="bf16"), dict(grad_accum_dtype="bf16"),
                                    dict(grad_accum_on="accelerator")])
def test_lent_updates_give_the_host_kernels_bits_with_other_state(tmp_path, option):
    # bf16 moments (widened for the update, stored rounded), a bf16 window sum, the sum kept on the accelerator
    runs = {}
    for share in (1.0, "none"):
        out = tmp_path / str(share)
        out.mkdir()
        module = fit(out, ZoffStrategy(start_method="fork", accelerator_state="none", weights_to_main_process=True,
                                       accelerator_update_share=share, **option), precision="bf16-true", accumulate=3,
                     max_steps=5)
        runs[share] = (module.state_dict(), read_probe(out))
    (lent_state, lent), (host_state, host) = runs[1.0], runs["none"]
    assert lent["telemetry"]["zoff/lent_units"] > 0
    assert lent["losses"] == host["losses"]
    for a, b in zip(lent_state.values(), host_state.values(), strict=True):
        assert torch.equal(a, b)


def test_split_gives_each_unit_to_the_side_that_finishes_it_first():
    split = UpdateSplit("auto", host_bytes=28, up_bytes=14)
    split.host_s, split.lent_s = 1.0, 2.0  # the accelerator takes twice as long per element
    # a: host done at 10 (lent would be 20); b: host 20 (lent 20 is not sooner); c: lent 20 < host 30; d: host 30
    assert split.choose([("a", 10), ("b", 10), ("c", 10), ("d", 10)]) == {"c"}
    split.observed(host=(4.0, 100), lent=(0.0, 100))  # a first measurement replaces the guess
    assert (split.host_s, split.lent_s) == (4.0, 0.0)
    split.observed(host=(0.0, 100), lent=(2.0, 100))  # a later one is averaged with the last: host 2, accelerator 1
    assert (split.host_s, split.lent_s) == (2.0, 1.0)
    assert split.choose([("a", 10), ("b", 10), ("c", 10)]) == {"a", "c"}  # a: lent 10 < 20; b: host 20 < 20 + 10
    split.observed(host=None, lent=(1.0, 0))  # nothing measured: nothing changes
    assert (split.host_s, split.lent_s) == (2.0, 1.0)


@pytest.mark.parametrize("share", [0.25, 0.5, 0.75])
def test_a_fraction_lends_that_share_of_the_elements(share):
    units = [(f"u{i}", 100) for i in range(40)]
    lent = UpdateSplit(share, host_bytes=28, up_bytes=14).choose(units)
    assert abs(len(lent) / len(units) - share) <= 1 / len(units)
    assert UpdateSplit(1.0, host_bytes=28, up_bytes=14).choose(units) == {name for name, _ in units}


def test_a_fraction_keeps_its_split_whatever_is_measured():
    split = UpdateSplit(0.5, host_bytes=28, up_bytes=14)
    split.observed(host=(1.0, 10), lent=(9.0, 10))
    assert (split.host_s, split.lent_s) == (0.5, 0.5)


def plan_for(share, capacity=None, trained=100):
    options = StateOptions(param_bytes=2, moment_bytes=4, moments=2, sum_bytes=0, update_share=share)
    shapes = [UnitShape("a", trained, trained, True), UnitShape("b", trained // 2, trained // 2, True)]
    return plan_memory(shapes, options, Machine(10**12, capacity), "none", model_bytes=0)


def test_the_plan_holds_the_lent_updates_slots():
    # bf16 model, fp32 Adam moments: a slot holds 4 + 8 + 2 bytes per element; the largest host unit has 100; one
    # piece's update workspace: its fp32 gradient, an fp32 and an fp64 temporary (16 bytes per element)
    plan = plan_for(0.5)
    assert plan.lend_piece == 100
    assert plan.lend_slots_bytes == LEND_SLOTS * 100 * 14
    assert plan.lending_bytes == LEND_SLOTS * 100 * 14 + 100 * 16
    assert plan.accelerator_transient_bytes == plan.lending_bytes  # nothing else on the accelerator
    assert plan_for(0.5, trained=4 * LEND_PIECE).lend_piece == LEND_PIECE  # pieces, not whole units
    assert plan_for("none", capacity=80 * 2**30).lending_bytes == 0
    assert plan_for("auto").lending_bytes == 0  # "auto" on a CPU: nothing to gain
    assert plan_for("auto", capacity=80 * 2**30).lending_bytes == plan.lending_bytes
    for moment_bytes, moments in [(4, 2), (2, 2), (4, 1), (2, 1)]:  # the plan's workspace is the update's
        options = StateOptions(param_bytes=2, moment_bytes=moment_bytes, moments=moments, sum_bytes=0)
        assert options.lend_workspace_bytes(10) == 10 * workspace_bytes(moment_bytes, moments)
    everything_there = plan_for(0.5).with_placement(dict.fromkeys(["a", "b"], Placement.ACCELERATOR))
    assert everything_there.lending_bytes == 0  # no host unit, nothing to lend


@pytest.mark.parametrize(("value", "parsed"), [("AUTO", "auto"), ("none", "none"), (0, "none"), (0.5, 0.5), ("1", 1.0)])
def test_update_share_option(value, parsed):
    assert ZoffConfig(accelerator_update_share=value).accelerator_update_share == parsed


@pytest.mark.parametrize("value", [1.5, -0.1, "half", True])
def test_update_share_refuses_what_it_cannot_mean(value):
    with pytest.raises(ValueError, match=r"accelerator_update_share=.*choose 'auto', 'none' or a fraction"):
        ZoffConfig(accelerator_update_share=value)
