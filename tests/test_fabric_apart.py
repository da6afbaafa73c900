"""LitGPT's scripts' setup order under `Fabric(strategy="zoff")`: `model = fabric.setup(model)`, then an optimizer
over the set-up model's parameters, then `fabric.setup_optimizers(optimizer)`. Against Fabric's DDP in the same order
and against zoff's joint `fabric.setup(model, optimizer)`; resumed from `fabric.save` in a new process; with torch's
`fused=`/`foreach=` hints; under `empty_init`; and `setup_module` alone for evaluation. 2 forked CPU ranks, gloo."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

from helpers.compare import rel_err
from helpers.fabric_loop import FabricTiny, micro_batch, train
from lightning_zoff import ZoffFabricStrategy, training
from lightning_zoff.placement import PlanDoesNotFit

STEPS, ACCUMULATE = 6, 2


def zoff_fabric(devices: int = 2) -> Fabric:
    return Fabric(accelerator="cpu", devices=devices, strategy=ZoffFabricStrategy(start_method="fork"))


@pytest.mark.slow
def test_apart_matches_ddp_and_equals_the_joint_setup(tmp_path):
    ddp = Fabric(accelerator="cpu", devices=2, strategy="ddp_fork").launch(
        train, STEPS, accumulate=ACCUMULATE, apart=True, weights_to=str(tmp_path / "ddp.pt"))
    apart = zoff_fabric().launch(train, STEPS, accumulate=ACCUMULATE, apart=True, weights_to=str(tmp_path / "apart.pt"),
                                 memory_to=str(tmp_path / "apart.json"))
    joint = zoff_fabric().launch(train, STEPS, accumulate=ACCUMULATE, weights_to=str(tmp_path / "joint.pt"),
                                 memory_to=str(tmp_path / "joint.json"))
    assert len(apart) == len(ddp) == STEPS * ACCUMULATE
    assert rel_err(apart, ddp) < 1e-5
    apart_weights, ddp_weights = torch.load(tmp_path / "apart.pt"), torch.load(tmp_path / "ddp.pt")
    assert apart_weights.keys() == ddp_weights.keys()
    for name, value in apart_weights.items():
        torch.testing.assert_close(value, ddp_weights[name], rtol=0, atol=1e-5, msg=name)
    # the two orders are one setup: the same plan, placement and memory, the same numbers bit for bit
    assert apart == joint
    joint_weights = torch.load(tmp_path / "joint.pt")
    assert all(torch.equal(value, joint_weights[name]) for name, value in apart_weights.items())
    report, joint_report = (json.loads((tmp_path / f"{run}.json").read_text()) for run in ("apart", "joint"))
    # the memory free when each run started (what the plan keeps for the rest of the process tree is a share of it)
    for machine_reading in ("host_capacity", "host_kept", "accelerator_capacity"):
        report.pop(machine_reading, None), joint_report.pop(machine_reading, None)
    assert report == joint_report
    assert report["host_units"] > 0


@pytest.mark.slow
def test_apart_resumes_from_fabric_save_in_a_new_process(tmp_path):
    path = tmp_path / "step3.ckpt"
    whole = zoff_fabric().launch(train, STEPS, accumulate=ACCUMULATE, apart=True, save=str(path), save_at=3)
    # fork: every launch is a new set of rank processes, sharing nothing with the run that saved
    resumed = zoff_fabric().launch(train, STEPS - 3, accumulate=ACCUMULATE, apart=True, load=str(path))
    assert resumed == whole[3 * ACCUMULATE:]


@pytest.mark.parametrize("hint", ["fused", "foreach"])
def test_torchs_implementation_hints_are_accepted_and_change_nothing(tmp_path, hint):
    plain = zoff_fabric().launch(train, 3, apart=True, weights_to=str(tmp_path / "plain.pt"))
    hinted = zoff_fabric().launch(train, 3, apart=True, weights_to=str(tmp_path / "hinted.pt"), **{hint: True})
    assert hinted == plain
    hinted_weights, plain_weights = torch.load(tmp_path / "hinted.pt"), torch.load(tmp_path / "plain.pt")
    assert all(torch.equal(value, plain_weights[name]) for name, value in hinted_weights.items())


def test_apart_under_empty_init_equals_the_joint_setup():
    apart = zoff_fabric().launch(train, 3, apart=True, empty_init=True)
    joint = zoff_fabric().launch(train, 3, empty_init=True)
    assert apart == joint
    assert apart[-1][0] < apart[0][0]  # it trains from the units' own initialisation


def evaluate(fabric: Fabric) -> list[float]:
    """`setup_module` alone: no-grad forwards of the sharded model, as evaluation and sampling do."""
    fabric.seed_everything(7)
    model = fabric.setup_module(FabricTiny())
    with torch.no_grad():
        return [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                for x, y in (micro_batch(i, fabric.global_rank, fabric.world_size) for i in range(2))]


def test_setup_module_alone_evaluates_as_ddp():
    ddp = Fabric(accelerator="cpu", devices=2, strategy="ddp_fork").launch(evaluate)
    zoff = zoff_fabric().launch(evaluate)
    assert rel_err(zoff, ddp) < 1e-6


def test_an_optimizer_before_the_model_is_refused_with_what_to_do():
    def optimizer_first(fabric):
        fabric.setup_optimizers(torch.optim.AdamW(FabricTiny().parameters()))

    with pytest.raises(ValueError, match=r"call `model = fabric.setup\(model\)` first, then make the"
                                         r" optimizer over `model.parameters\(\)`"):
        zoff_fabric().launch(optimizer_first)


def test_a_plan_that_cannot_fit_is_refused_when_the_optimizer_is_set_up(monkeypatch):
    monkeypatch.setenv("ZOFF_HOST_MEMORY_BYTES", str(100_000))
    built = []
    monkeypatch.setattr(training.OffloadEngine, "__init__", lambda *a, **k: built.append(1))

    def apart(fabric):
        module = FabricTiny()
        model = fabric.setup(module)  # evaluation needs no optimizer state: sharded all the same
        with torch.no_grad():
            x, _ = micro_batch(0, fabric.global_rank, fabric.world_size)
            model(x)
        fabric.setup_optimizers(module.configure_optimizers())

    with pytest.raises(PlanDoesNotFit, match="does not fit the host"):
        zoff_fabric().launch(apart)
    assert not built
