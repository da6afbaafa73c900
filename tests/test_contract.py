"""The doors' contract (`lightning_zoff.contract.Core`), one training through each door: the same model, data, seed,
steps, accumulation and clipping through the Trainer's `ZoffStrategy` and Fabric's `ZoffFabricStrategy` on 2 forked
gloo CPU ranks give the same losses and final weights bit for bit as each other, and those of torch's AdamW on one
process in fp32 within float rounding."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric

from helpers.compare import rel_err
from helpers.fabric_loop import FabricTiny, train, trainer_loader
from helpers.reference import SEED, train_on_one_process
from helpers.tiny_module import read_probe
from helpers.trainer import fit
from lightning_zoff import ZoffFabricStrategy, ZoffStrategy

STEPS, ACCUMULATE, MAX_NORM = 4, 2, 0.84  # clips some steps only (the norms: 0.79 to 0.87)


def through_trainer(out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    pl.seed_everything(SEED)
    module = FabricTiny()
    strategy = ZoffStrategy(start_method="fork", weights_to_main_process=True)
    fit(module, trainer_loader(0, STEPS * ACCUMULATE, 2), strategy, out=out, max_steps=STEPS, accumulate=ACCUMULATE,
        clip=MAX_NORM, use_distributed_sampler=False)
    return read_probe(out)["losses"], module.state_dict()


def through_fabric(out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ZoffFabricStrategy(start_method="fork"))
    losses = fabric.launch(train, STEPS, accumulate=ACCUMULATE, max_norm=MAX_NORM, weights_to=str(out / "weights.pt"))
    # each micro-batch's mean over the ranks in fp32, as `FabricTiny` takes it under the Trainer
    return [torch.tensor(ranks).mean().item() for ranks in losses], torch.load(out / "weights.pt")


DOORS = {"trainer": through_trainer, "fabric": through_fabric}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each door's run, once: each micro-batch's loss (the mean over the ranks) and the final fp32 weights."""
    done = {}

    def run(door: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        if door not in done:
            done[door] = DOORS[door](tmp_path_factory.mktemp(door))
        return done[door]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("door", list(DOORS))
def test_the_door_trains_as_torch_adamw_on_one_process(runs, door):
    losses, weights = runs(door)
    ranks_losses, expected = train_on_one_process(STEPS, ACCUMULATE, MAX_NORM)
    assert rel_err(losses, [sum(ranks) / len(ranks) for ranks in ranks_losses]) < 1e-5
    assert weights.keys() == {f"model.{name}" for name in expected}
    for name, value in expected.items():
        torch.testing.assert_close(weights[f"model.{name}"], value, rtol=1e-4, atol=1e-5)


def test_both_doors_train_alike(runs):
    (trainer_losses, trainer_weights), (fabric_losses, fabric_weights) = runs("trainer"), runs("fabric")
    assert len(trainer_losses) == len(fabric_losses) == STEPS * ACCUMULATE
    assert trainer_losses == fabric_losses  # bit for bit: the same calls into the core
    assert trainer_weights.keys() == fabric_weights.keys()
    for name, value in trainer_weights.items():
        assert torch.equal(fabric_weights[name], value), name
