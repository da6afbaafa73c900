"""fp16 loss scaling and skipped steps: a non-finite gradient changes nothing, on every rank, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import helpers.trainer
from helpers.tiny import token_loader
from helpers.tiny_module import TinyModule
from lightning_zoff import ZoffPrecision, ZoffStrategy
from lightning_zoff.precision_math import DynamicLossScaler

BAD_STEP = 3


class PoisonedStep(TinyModule):
    """Multiplies the loss of one optimizer step's micro-batches by `poison` (inf or NaN)."""

    def __init__(self, poison: float):
        super().__init__()
        self.poison = poison

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * self.poison if self.trainer.global_step == BAD_STEP else loss


class StateWatch(pl.Callback):
    """Snapshots the whole optimizer-side state and the model's shards around every optimizer step (from the start of
    its window: between the window's last backward and the step, the shards of units whose state is on the
    accelerator hold their gradient); writes what changed per step."""

    def __init__(self, out: Path):
        self.out, self.before, self.rows = out, None, []

    def _state(self, trainer):
        engine = trainer.strategy.engine
        engine.wait_idle()  # overlapped updates finish in the background
        tensors = [t.clone() for u in engine.units for t in u.state]
        tensors += [p.to_local().detach().clone() for p in trainer.lightning_module.parameters()]
        steps = [p.step for u in engine.units for p in u.trained]
        return tensors, steps, [g["lr"] for g in trainer.optimizers[0].param_groups]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.before = (self._state(trainer), trainer.precision_plugin.loss_scale)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.before is None or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        (tensors, steps, lrs), scale = self.before
        after, steps_after, lrs_after = self._state(trainer)
        self.rows.append({
            "skipped": trainer.strategy.last_step.skipped,
            "unchanged": all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                             for a, b in zip(tensors, after, strict=True)),
            "steps_unchanged": steps == steps_after, "lr_unchanged": lrs == lrs_after,
            "scale_before": scale, "scale_after": trainer.precision_plugin.loss_scale,
        })
        self.before = None

    def on_train_end(self, trainer, pl_module):
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def run(tmp_path, poison, precision, accumulate=2, accelerator_state="auto"):
    pl.seed_everything(5)
    helpers.trainer.fit(PoisonedStep(poison), token_loader(),
                        ZoffStrategy(start_method="fork", accelerator_state=accelerator_state), plugins=[precision],
                        max_steps=7, accumulate=accumulate, clip=1.0, callbacks=[StateWatch(tmp_path)])
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize(("precision", "poison", "accumulate", "accelerator_state"), [
    (ZoffPrecision("16-mixed", hysteresis=1), float("inf"), 2, "auto"),
    (ZoffPrecision("bf16-mixed"), float("nan"), 2, "auto"),
    # half the state on the accelerator, a window of one: those units' gradients wait in their shards
    (ZoffPrecision("16-mixed", hysteresis=1), float("inf"), 1, 0.5),
])
def test_non_finite_step_is_skipped_exactly(tmp_path, precision, poison, accumulate, accelerator_state):
    for rows in run(tmp_path, poison, precision, accumulate, accelerator_state):
        assert len(rows) == 7
        assert [r["skipped"] for r in rows] == [i == BAD_STEP for i in range(7)]
        bad = rows[BAD_STEP]
        assert bad["unchanged"]
        assert bad["steps_unchanged"]
        assert bad["lr_unchanged"]  # nothing moved, bit for bit
        # StepLR(step_size=3) decays after 3 real updates: at index 2, then (one step skipped) at 6, not 5
        assert [i for i, r in enumerate(rows) if not r["lr_unchanged"]] == [2, 6]
        others = [r for i, r in enumerate(rows) if i != BAD_STEP]
        assert not any(r["unchanged"] for r in others)  # training continues before and after
        if precision.scaler is not None:
            assert bad["scale_after"] == bad["scale_before"] / 2 == 2.0**15
            assert all(r["scale_after"] == r["scale_before"] for r in others)


def test_scaler_hysteresis_growth_and_state():
    scaler = DynamicLossScaler(scale=1024.0, growth_interval=3, hysteresis=2, min_scale=256.0)
    scaler.update(overflow=True)
    assert scaler.scale == 1024.0  # first overflow tolerated (hysteresis 2)
    scaler.update(overflow=True)
    assert scaler.scale == 512.0
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 1024.0
    for _ in range(6):
        scaler.update(overflow=True)
    assert scaler.scale == 256.0  # floor
    copy = DynamicLossScaler()
    copy.load_state_dict(scaler.state_dict())
    assert copy == scaler
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=2.0)


def test_precision_plugin_checkpoints_the_scaler():
    plugin = ZoffPrecision("16-mixed", scale=512.0)
    plugin.scaler.update(overflow=True)
    other = ZoffPrecision("16-mixed")
    other.load_state_dict(plugin.state_dict())
    assert other.scaler == plugin.scaler


class Dot(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(64))

    def forward(self, c):
        return (self.w * c).sum()


class WindowSum(pl.LightningModule):
    """loss = w . c_k at micro-batch k on every rank, so each micro-gradient is exactly c_k / accumulate."""

    def __init__(self, cs: torch.Tensor):
        super().__init__()
        self.model = Dot()
        self.cs = cs

    def training_step(self, batch, batch_idx):
        return self.model(self.cs[batch_idx].to(torch.bfloat16)).float()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class ReadWindowGradient(pl.Callback):
    def __init__(self, out: Path):
        self.out = out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        engine = trainer.strategy.engine
        engine.wait_idle()  # the gradient lands in the background
        unit = engine.units[0]
        grad = unit.window_grad[: unit.layout.slots[0].numel].double()
        torch.save(grad, self.out / f"grad{trainer.global_rank}.pt")


WINDOW = 16


def window_error(tmp_path, accum, where):
    # micro-gradients exact in bf16 (8 significant bits in [1, 2)); both ranks see the same c, so the bf16
    # reduce-scatter sum 2c is exact too, and only the host accumulation can round
    g = torch.Generator().manual_seed(0)
    cs = (1 + torch.randint(0, 256, (WINDOW, 64), generator=g) / 256).to(torch.bfloat16).float()
    data = torch.utils.data.TensorDataset(torch.zeros(2 * WINDOW, 1))  # only the batch count matters
    helpers.trainer.fit(WindowSum(cs), torch.utils.data.DataLoader(data, batch_size=1),
                        ZoffStrategy(start_method="fork", grad_accum_dtype=accum, grad_accum_on=where),
                        precision="bf16-mixed", max_steps=1, accumulate=WINDOW,
                        callbacks=[ReadWindowGradient(tmp_path)])
    exact = 2 * cs.double().sum(0) / WINDOW  # summed over both ranks: the engine's sum before the 1/world
    errors = []
    for rank in (0, 1):
        got = torch.load(tmp_path / f"grad{rank}.pt")
        shard = torch.chunk(exact, 2)[rank]
        errors.append(((got - shard).abs() / shard.abs()).max().item())
    return max(errors)


def test_window_sum_precision_table(tmp_path):
    table = {}
    for accum in ("fp32", "bf16"):
        for where in ("host", "accelerator"):
            out = tmp_path / f"{accum}_{where}"
            out.mkdir()
            table[accum, where] = window_error(out, accum, where)
    print("\nwindow sum of 16 bf16-exact micro-gradients, read at the boundary (the accelerator is the CPU here):")
    print(f"{'accumulation':>14} {'where':>12} {'rel max error':>14}")
    for (accum, where), err in table.items():
        print(f"{accum:>14} {where:>12} {err:>14.3e}")
    assert table["fp32", "host"] == table["fp32", "accelerator"] == 0.0  # exact
    assert table["bf16", "host"] == table["bf16", "accelerator"] > 1e-4  # rounds at every micro-batch


def test_accumulation_dtype_must_fit_the_model():
    from lightning_zoff.doors import check_accum_dtype

    with pytest.raises(ValueError, match=r"grad_accum_dtype='fp8'; choose 'bf16', 'fp16' or 'fp32'"):
        ZoffStrategy(grad_accum_dtype="fp8")
    strategy = ZoffStrategy(grad_accum_dtype="fp16")
    precision = ZoffPrecision("bf16-mixed")
    with pytest.raises(ValueError,
                       match=r"cannot accumulate gradients of a bf16-mixed model; choose one of \['bf16', 'fp32'\]"):
        check_accum_dtype(strategy.config.grad_accum_dtype, precision.precision, precision.param_dtype)


class LargeGradients(pl.LightningModule):
    """Each micro-gradient is 5000 per element on each rank: finite in fp16, and so is the reduced 10000,
    but 16 of them sum to 160000, past fp16's 65504."""

    def __init__(self):
        super().__init__()
        self.model = Dot()

    def training_step(self, batch, batch_idx):
        # Lightning divides by the 16 micro-batches and the loss scale (16) multiplies back: gradient = c
        return self.model(torch.full((64,), 5000.0, dtype=torch.float16)).float()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class RecordSkips(pl.Callback):
    def __init__(self, out: Path):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(trainer.strategy.last_step.skipped))


@pytest.mark.parametrize(("accum", "where", "skipped"), [
    ("fp16", "host", True), ("fp16", "accelerator", True), ("fp32", "host", False), ("fp32", "accelerator", False),
])
def test_overflow_is_judged_on_the_stored_sum(tmp_path, accum, where, skipped):
    data = torch.utils.data.TensorDataset(torch.zeros(2 * WINDOW, 1))
    helpers.trainer.fit(LargeGradients(), torch.utils.data.DataLoader(data),
                        ZoffStrategy(start_method="fork", grad_accum_dtype=accum, grad_accum_on=where),
                        max_steps=1, accumulate=WINDOW, callbacks=[RecordSkips(tmp_path)],
                        plugins=[ZoffPrecision("16-true", scale=16.0)])
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [skipped, skipped]
