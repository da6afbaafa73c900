"""Bad input stops before any training step, with a message that says what to do."""

from __future__ import annotations

import subprocess
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_zoff import ZoffPrecision, ZoffStrategy
from tiny import TinyModule, token_loader


class NoStep(TinyModule):
    def training_step(self, batch, batch_idx):
        raise AssertionError("training must not start")


class TwoOptimizers(NoStep):
    def configure_optimizers(self):
        half = len(list(self.parameters())) // 2
        params = list(self.parameters())
        return [torch.optim.AdamW(params[:half]), torch.optim.AdamW(params[half:])]


class Manual(NoStep):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


def forked_trainer(devices=1, **trainer_kwargs):
    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=ZoffStrategy(start_method="fork"), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )


def run(module, devices=1, **trainer_kwargs):
    forked_trainer(devices, **trainer_kwargs).fit(module, token_loader(n=16))


@contextmanager
def fails(error: type[Exception], match: str):
    """The error as zoff raised it, in a rank or before the ranks started: the caller gets that very exception (type
    and message; a rank's traceback is its cause), so the message is the whole text it reads."""
    with pytest.raises(error, match=match) as info:
        yield
    assert type(info.value) is error
    assert "Traceback" not in str(info.value)


def test_unsupported_optimizer_names_the_supported():
    with fails(TypeError, r"supports torch\.optim\.AdamW, torch\.optim\.Adam, .*lightning_zoff\.optim\.Lion;"
                          r" configure_optimizers returned torch\.optim\.sgd\.SGD"):
        run(NoStep("sgd"))


def test_two_optimizers():
    with fails(ValueError, "exactly one optimizer.*param groups"):
        run(TwoOptimizers())


def test_clip_by_value():
    trainer = forked_trainer(gradient_clip_val=1.0, gradient_clip_algorithm="value")
    with fails(ValueError, "gradient_clip_algorithm='norm'"):
        trainer.fit(NoStep(), token_loader(n=16))
    assert trainer.strategy.launcher.procs == []  # refused before any rank started


def test_manual_optimization():
    trainer = forked_trainer()
    with fails(ValueError, "automatic optimization"):
        trainer.fit(Manual(), token_loader(n=16))
    assert trainer.strategy.launcher.procs == []


@pytest.mark.parametrize(("mistake", "last_line"), [
    # known before the ranks start: refused in the main process, so no rank prints a traceback of its own
    ("manual", "ValueError: strategy='zoff' supports automatic optimization only"),
    # known in the ranks only (configure_optimizers): the main process is rank 0 and its message comes last
    ("sgd", "[rank0]: TypeError: strategy='zoff' runs the optimizer step on the CPU and supports"),
])
def test_default_launcher_ends_with_the_message(tmp_path, mistake, last_line):
    script = Path(__file__).parent / "scripts" / "refused.py"
    proc = subprocess.run([sys.executable, str(script), mistake], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.rstrip().splitlines()[-1].startswith(last_line), proc.stderr[-3000:]
    if mistake == "manual":
        assert "[rank" not in proc.stderr
        assert "Initializing distributed" not in proc.stderr


def test_precision_64_is_refused_at_trainer_construction():
    with pytest.raises(ValueError, match=r"precision='64-true'.*'32-true', 'bf16-mixed', 'bf16-true', '16-mixed'"):
        pl.Trainer(accelerator="cpu", devices=1, strategy="zoff", precision="64-true")


def test_precision_flag_becomes_zoff_precision():
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="zoff", precision="bf16-true", logger=False)
    assert isinstance(trainer.strategy.precision_plugin, ZoffPrecision)
    assert trainer.strategy.precision_plugin.param_dtype == torch.bfloat16
    assert ZoffPrecision("16-mixed").param_dtype == torch.float16
    with pytest.raises(ValueError, match="fp16 only"):
        ZoffPrecision("bf16-mixed", hysteresis=1)
    with pytest.raises(ValueError, match=r"precision='fp8'.*'bf16-mixed'.*'16-mixed'"):
        ZoffPrecision("fp8")


def test_uneven_predict_is_refused(tmp_path):
    module = TinyModule()
    module.predict_step = lambda batch, batch_idx: module.model(batch[0]).argmax(-1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZoffStrategy(start_method="fork"), logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with fails(ValueError, "different batch counts"):
        trainer.predict(module, token_loader(n=5, batch_size=2))  # samples 3 + 2: batches 2 + 1


def test_bf16_moments_with_a_beta_that_cannot_decay_warn():
    from lightning_zoff.optim import UpdateRule
    from lightning_zoff.optim.rules import warn_if_bf16_moments_cannot_decay

    # why: a decay by 0.1% is less than half a bf16 ulp, so rounding to nearest gives the old value back
    v = torch.tensor([1.0, 3.0, 1e-8, 0.7]).to(torch.bfloat16)
    assert torch.equal((v.float() * 0.999).to(torch.bfloat16), v)
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.warns(UserWarning, match=r"beta2=0\.999 \(exp_avg_sq\): a step decays such a moment by less than"):
        warn_if_bf16_moments_cannot_decay(UpdateRule.ADAMW, torch.optim.AdamW(params))  # torch's default betas
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_bf16_moments_cannot_decay(UpdateRule.ADAMW, torch.optim.AdamW(params, betas=(0.9, 0.95)))
        warn_if_bf16_moments_cannot_decay(UpdateRule.LION, torch.optim.AdamW(params, betas=(0.999, 0.99)))


def test_model_larger_than_host_memory_is_refused_before_it_is_sharded(monkeypatch):
    from lightning_zoff import strategy
    from lightning_zoff.offload.memory_plan import PlanDoesNotFit

    def never(*args, **kwargs):
        raise AssertionError("the model must not be sharded (nor its fp32 copies made) when the plan cannot fit")

    monkeypatch.setattr(strategy, "shard_model", never)  # the forked rank inherits both
    monkeypatch.setenv("ZOFF_HOST_MEMORY_BYTES", str(100_000))
    # 32-true: 16 B per element (master, moments, the 4-byte gradient); nothing fits on no memory but more ranks
    with fails(PlanDoesNotFit, r"does not fit the host \(0\.\d MB needed, 0\.0 MB usable\).*16 B per element on the"
                               r" host.*more ranks \(GPUs or nodes\) split the state among them\.$"):
        run(NoStep())


class Gain(torch.nn.Module):
    """A parameter with no reset_parameters(): nothing can initialise it after an empty (meta) init."""

    def __init__(self):
        super().__init__()
        self.g = torch.nn.Parameter(torch.ones(4))


class MetaWithoutInit(NoStep):
    def __init__(self):
        super().__init__()
        self.gain = Gain()


def test_meta_module_without_reset_parameters():
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZoffStrategy(start_method="fork"), max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with trainer.init_module(empty_init=True):
        module = MetaWithoutInit()
    with fails(TypeError, "Gain was built on the meta device .* no reset_parameters"):
        trainer.fit(module, token_loader(n=16))
