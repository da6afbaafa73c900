"""`Fabric(strategy="zoff")`: a plain Fabric loop against the same loop under Fabric's DDP with torch's AdamW, an fp16
overflow on one rank, checkpoints that either front door writes and the other resumes at another world size, and the
refusals. Ranks are forked, 2 (or 3) CPU processes on gloo."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.compare import rel_err
from helpers.fabric_loop import FabricTiny, micro_batch, train, trainer_loader
from lightning_zoff import ZoffFabricPrecision, ZoffFabricStrategy, ZoffStrategy, training
from lightning_zoff.placement import PlanDoesNotFit

STEPS = 8
SAVED_AT = 4


def zoff_fabric(devices: int = 2, **options) -> Fabric:
    plugins = options.pop("plugins", None)
    return Fabric(accelerator="cpu", devices=devices, strategy=ZoffFabricStrategy(start_method="fork", **options),
                  plugins=plugins)


def mean_losses(losses: list[list[float]]) -> list[float]:
    return [sum(ranks) / len(ranks) for ranks in losses]


def test_registered_by_name_in_fabric():
    assert "zoff" in STRATEGY_REGISTRY
    assert "zoff_no_offload" in STRATEGY_REGISTRY
    fabric = Fabric(accelerator="cpu", devices=2, strategy="zoff", precision="bf16-mixed")
    assert isinstance(fabric.strategy, ZoffFabricStrategy)
    assert fabric.strategy.config.offload
    assert isinstance(fabric.strategy.precision, ZoffFabricPrecision)
    assert fabric.strategy.precision.precision == "bf16-mixed"
    assert not Fabric(accelerator="cpu", devices=2, strategy="zoff_no_offload").strategy.config.offload


@pytest.mark.slow
def test_zoff_matches_ddp_adamw_with_accumulation_and_clipping(tmp_path):
    steps = 6
    ddp = Fabric(accelerator="cpu", devices=2, strategy="ddp_fork").launch(
        train, steps, accumulate=2, weights_to=str(tmp_path / "ddp.pt"))
    zoff = zoff_fabric().launch(train, steps, accumulate=2, weights_to=str(tmp_path / "zoff.pt"))
    assert len(zoff) == len(ddp) == steps * 2  # every micro-batch, each rank's loss
    assert rel_err(zoff, ddp) < 1e-5
    assert mean_losses(zoff)[-1] < mean_losses(zoff)[0] - 0.3  # it learns, so the comparison means something
    zoff_weights, ddp_weights = torch.load(tmp_path / "zoff.pt"), torch.load(tmp_path / "ddp.pt")
    assert zoff_weights.keys() == ddp_weights.keys()
    for name, value in zoff_weights.items():
        assert value.dtype == ddp_weights[name].dtype == torch.float32
        assert type(value) is torch.Tensor  # gathered whole from the shards
        torch.testing.assert_close(value, ddp_weights[name], rtol=0, atol=1e-5)


BAD_STEP = 3


def poisoned_run(fabric: Fabric) -> list[list[dict]]:
    """7 fp16 steps, rank 1's loss infinite at step BAD_STEP only; how each step changed each rank's state."""
    fabric.seed_everything(5)
    module = FabricTiny()
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    engine = fabric.strategy.engine
    precision = fabric.strategy.precision

    def snapshot():
        engine.wait_idle()
        tensors = [t.clone() for u in engine.units for t in u.state]
        tensors += [p.to_local().detach().clone() for p in module.parameters()]
        return tensors, [p.step for u in engine.units for p in u.trained], precision.loss_scale

    rows = []
    for step in range(7):
        x, y = micro_batch(step, fabric.global_rank, fabric.world_size)
        loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        if step == BAD_STEP and fabric.global_rank == 1:
            loss = loss * float("inf")
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        (before, steps_before, scale_before) = snapshot()
        optimizer.step()
        optimizer.zero_grad()
        after, steps_after, scale_after = snapshot()
        rows.append({"skipped": fabric.strategy.last_step.skipped,
                     "unchanged": all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                      for a, b in zip(before, after, strict=True)),
                     "steps_unchanged": steps_before == steps_after,
                     "scale_before": scale_before, "scale_after": scale_after})
    gathered = [None] * fabric.world_size
    torch.distributed.all_gather_object(gathered, rows)
    return gathered


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    fabric = zoff_fabric(plugins=[ZoffFabricPrecision("16-mixed", hysteresis=1)])
    for rows in fabric.launch(poisoned_run):
        assert [r["skipped"] for r in rows] == [i == BAD_STEP for i in range(7)]
        bad = rows[BAD_STEP]
        assert bad["unchanged"]
        assert bad["steps_unchanged"]
        assert bad["scale_after"] == bad["scale_before"] / 2 == 2.0**15
        others = [r for i, r in enumerate(rows) if i != BAD_STEP]
        assert not any(r["unchanged"] for r in others)  # training goes on before and after
        assert all(r["scale_after"] == r["scale_before"] for r in others)


class LossFile(pl.Callback):
    """Rank 0 writes the losses it recorded (each step's mean over all ranks) and the last step to `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps({"losses": pl_module.losses, "global_step": trainer.global_step}))


def trainer_fit(out: Path, devices: int, first_step: int, steps: int, ckpt_path=None, callbacks=()) -> list[float]:
    """The steps `first_step` (a checkpoint's, resumed from `ckpt_path`) to `first_step + steps` of the same loop under
    the Trainer (one micro-batch per step, clipping at 0.5); each step's mean loss over all ranks."""
    pl.seed_everything(7)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=ZoffStrategy(start_method="fork"),
                         max_steps=first_step + steps, gradient_clip_val=0.5,
                         callbacks=[LossFile(out / "losses.json"), *callbacks],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(callbacks), use_distributed_sampler=False)
    trainer.fit(FabricTiny(), trainer_loader(first_step, steps, devices), ckpt_path=ckpt_path)
    ran = json.loads((out / "losses.json").read_text())
    assert ran["global_step"] == first_step + steps  # the count went on from the checkpoint's
    return ran["losses"]


@pytest.fixture(scope="module")
def fabric_run(tmp_path_factory):
    """8 steps on 2 ranks under Fabric, uninterrupted, saving after 4."""
    path = tmp_path_factory.mktemp("fabric") / "step4.ckpt"
    return path, zoff_fabric().launch(train, STEPS, save=str(path), save_at=SAVED_AT)


@pytest.mark.slow
def test_fabric_checkpoint_resumes_on_three_ranks_in_fabric_and_in_the_trainer(fabric_run, tmp_path):
    path, full = fabric_run
    assert path.is_dir()
    assert (path / "meta.pt").exists()
    expected = mean_losses(full)[SAVED_AT:]
    fabric = zoff_fabric(devices=3).launch(train, STEPS - SAVED_AT, load=str(path))
    assert rel_err(mean_losses(fabric), expected) < 1e-5
    trainer = trainer_fit(tmp_path, 3, SAVED_AT, STEPS - SAVED_AT, ckpt_path=path)
    assert rel_err(trainer, expected) < 1e-5


def test_a_fabric_checkpoint_without_a_step_count_is_refused_by_the_trainer_before_any_rank_starts(fabric_run,
                                                                                                    tmp_path):
    path = tmp_path / "no_step.ckpt"
    shutil.copytree(fabric_run[0], path)
    meta = torch.load(path / "meta.pt", weights_only=False)
    del meta["global_step"]  # what fabric.save(path, {"model": model, "optimizer": optimizer}) writes
    torch.save(meta, path / "meta.pt")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZoffStrategy(start_method="fork"), max_steps=2,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"no_step\.ckpt: holds no step count .*'global_step'.* every step again"):
        trainer.fit(FabricTiny(), trainer_loader(0, 2, 2), ckpt_path=path)
    assert trainer.strategy.launcher.procs == []  # no rank started


@pytest.mark.slow
def test_trainer_checkpoint_resumes_on_three_ranks_in_fabric(fabric_run, tmp_path):
    every4 = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=SAVED_AT)
    trainer = trainer_fit(tmp_path, 2, 0, STEPS, callbacks=[every4])
    assert rel_err(trainer, mean_losses(fabric_run[1])) < 1e-5  # the two doors train alike, step for step
    resumed = zoff_fabric(devices=3).launch(train, STEPS - SAVED_AT, load=str(tmp_path / "epoch=0-step=4.ckpt"))
    assert rel_err(mean_losses(resumed), trainer[SAVED_AT:]) < 1e-5


def test_unsupported_optimizer_is_refused():
    def sgd(fabric):
        module = FabricTiny()
        fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))

    with pytest.raises(TypeError, match="SGD"):  # the rank's own exception, raised in the main process
        zoff_fabric().launch(sgd)


def test_plan_that_does_not_fit_is_refused_before_sharding(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the model must not be sharded when the plan cannot fit")

    monkeypatch.setattr(training, "shard_model", never)  # the forked ranks inherit both
    monkeypatch.setenv("ZOFF_HOST_MEMORY_BYTES", str(100_000))

    def fit(fabric):
        module = FabricTiny()
        fabric.setup(module, module.configure_optimizers())

    with pytest.raises(PlanDoesNotFit, match="does not fit the host"):
        zoff_fabric().launch(fit)


def test_empty_init_materialises_each_ranks_own_units():
    def build(fabric):
        with fabric.init_module(empty_init=True):
            module = FabricTiny()
        on_meta = all(p.is_meta for p in module.parameters())
        model, optimizer = fabric.setup(module, module.configure_optimizers())
        x, y = micro_batch(0, fabric.global_rank, fabric.world_size)
        fabric.backward(torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        optimizer.step()
        local = {n: p.to_local().numel() for n, p in module.named_parameters()}
        return on_meta, local, {n: p.numel() for n, p in module.named_parameters()}

    on_meta, local, whole = zoff_fabric().launch(build)
    assert on_meta
    assert sum(local.values()) < sum(whole.values())  # rank 0 holds its shards, not the model
