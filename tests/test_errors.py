"""Bad input stops before any training step, with a message that says what to do."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import helpers.trainer
from helpers.tiny import TinyLM, token_loader
from helpers.tiny_module import TinyModule
from lightning_zoff import ZoffPrecision, ZoffStrategy
from lightning_zoff.trainer.checks import check_configured_optimizers
from zoffbench.harness import free_ports


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
    helpers.trainer.fit(module, token_loader(n=16), ZoffStrategy(start_method="fork"), devices=devices, max_steps=2,
                        **trainer_kwargs)


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


class NeedsTheTrainer(NoStep):
    def configure_optimizers(self):
        total = self.trainer.estimated_stepping_batches
        return torch.optim.SGD(self.parameters(), lr=1.0 / total)


class BuiltInConfigureModel(NoStep):
    def __init__(self):
        super().__init__("sgd")
        del self.model

    def configure_model(self):
        if not hasattr(self, "model"):
            self.model = TinyLM()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RecordsWhereItAllocates(TinyModule):
    def configure_optimizers(self):
        self.scratch = torch.zeros(4)
        return super().configure_optimizers()


def test_configure_optimizers_is_checked_before_the_ranks_where_it_can_run():
    with fails(TypeError, r"configure_optimizers returned torch\.optim\.sgd\.SGD"):
        check_configured_optimizers(TinyModule("sgd"))  # returned with an LR scheduler, in a dict
    with fails(ValueError, "exactly one optimizer; configure_optimizers returned 2"):
        check_configured_optimizers(TwoOptimizers())
    module = RecordsWhereItAllocates()
    check_configured_optimizers(module)  # AdamW: fine
    assert module.scratch.is_meta  # what it allocates here costs nothing
    # what needs the ranks is left to them: no refusal here, whatever they will find
    check_configured_optimizers(NeedsTheTrainer("sgd"))  # not attached to a Trainer yet
    check_configured_optimizers(BuiltInConfigureModel())  # no parameters yet: torch refuses an empty list here
    attached = TinyModule("sgd")
    attached.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    check_configured_optimizers(attached)  # an earlier run's Trainer: not asked here


REFUSED = Path(__file__).parent / "scripts" / "refused.py"


class RefusedRun:
    """tests/scripts/refused.py started with the default launcher (`args`: the mistake, the checkpoint), in the
    background: its temporary files go to `tmp_path`, its kernel builds to `kernel_cache` where given, its ranks meet
    on `port` where given."""

    def __init__(self, tmp_path: Path, *args: str, kernel_cache: Path | None = None, port: int | None = None) -> None:
        self.trace, self.stdout, self.stderr = tmp_path / "trace.txt", tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        env = {**os.environ, "TMPDIR": str(tmp_path), "REFUSED_TRACE": str(self.trace)}
        if port is not None:
            env["MASTER_PORT"] = str(port)
        if kernel_cache is not None:
            env["ZOFF_CACHE_DIR"] = str(kernel_cache)
        with open(self.stdout, "w") as stdout, open(self.stderr, "w") as stderr:  # files: no pipe to fill up
            self.proc = subprocess.Popen([sys.executable, str(REFUSED), *args], stdout=stdout, stderr=stderr, env=env)

    def wait(self) -> tuple[int, list[str], list[str]]:
        """Its exit code, its output's lines (stdout's, then stderr's), and the heavy things it did (`REFUSED_TRACE`'s
        lines: ranks started, process groups joined, models sharded)."""
        code = self.proc.wait(timeout=300)
        events = self.trace.read_text().splitlines() if self.trace.exists() else []
        return code, (self.stdout.read_text() + self.stderr.read_text()).rstrip().splitlines(), events

    def end(self) -> None:
        """Kill and reap the run if no test waited for it (one deselected), so no process outlives the module."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


REFUSALS = [
    ("manual", "ValueError: strategy='zoff' supports automatic optimization only"),
    ("sgd", "TypeError: strategy='zoff' runs the optimizer step on the CPU and supports torch.optim.AdamW"),
    ("two", "ValueError: strategy='zoff' drives exactly one optimizer; configure_optimizers returned 2."),
    ("missing", "lightning_zoff.checkpoint.files.CheckpointError: {ckpt}: no such checkpoint"),
    ("foreign", "lightning_zoff.checkpoint.files.CheckpointError: {ckpt}: cannot be read"),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> Iterator[dict[str, tuple[Path, Path, RefusedRun]]]:
    """Each mistake of REFUSALS' run, all started at once (each is an interpreter importing Lightning, one core's
    work): its directory, the checkpoint it was given and the run."""
    runs = {}
    for mistake, _ in REFUSALS:
        tmp_path = tmp_path_factory.mktemp(mistake)
        ckpt = tmp_path / ("notes.txt" if mistake == "foreign" else "missing.ckpt")
        if mistake == "foreign":
            ckpt.write_text("not a checkpoint")
        args = [str(ckpt)] if mistake in ("missing", "foreign") else []
        runs[mistake] = tmp_path, ckpt, RefusedRun(tmp_path, mistake, *args, kernel_cache=tmp_path / "kernels")
    yield runs
    for _, _, run in runs.values():
        run.end()


@pytest.mark.slow
@pytest.mark.parametrize(("mistake", "message"), REFUSALS)
def test_refused_before_the_ranks_start_with_the_message_once(refusals, mistake, message):
    tmp_path, ckpt, run = refusals[mistake]
    code, lines, events = run.wait()
    message = message.format(ckpt=ckpt)
    output = "\n".join(lines)
    assert code == 1
    assert lines[-1].startswith(message), output[-3000:]
    assert output.count(message) == 1
    assert len(lines) < 25, output
    assert "Initializing distributed" not in output  # no rank started, so none printed a traceback of its own
    # Nothing heavy ran before the refusal: no rank besides this process, no process group, no sharding, no kernel
    # build (the cache stays empty). How long a refusal takes: scripts/bench/bench_refusal.py.
    assert events == [], output[-3000:]
    assert not (tmp_path / "kernels").exists()


def checkpoint_of_another_model(tmp_path: Path) -> Path:
    module = TinyModule()
    module.model = TinyLM(n_blocks=2)  # the refused run's has 3 blocks
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "other", save_last=True, save_top_k=0)]
    helpers.trainer.fit(module, token_loader(n=8), ZoffStrategy(start_method="fork"), devices=1, max_steps=1,
                        callbacks=callbacks, enable_checkpointing=True)
    return tmp_path / "other" / "last.ckpt"


RANK_ERRORS = [
    # every rank finds it when it compares the checkpoint with its model
    ("other", r"(\[rank[01]\]: )lightning_zoff\.checkpoint\.files\.CheckpointError: .*/meta\.pt: written for another"),
    # rank 1 alone: rank 0 then loses it in a collective, an error of its own that follows from rank 1's
    ("rank1", r"(\[rank1\]: )ValueError: rank 1 cannot go on"),
]


@pytest.fixture(scope="module")
def rank_errors(tmp_path_factory) -> Iterator[dict[str, RefusedRun]]:
    """Each mistake of RANK_ERRORS' run, both started at once, each with a port of its own (a run is rank 0's
    interpreter, then rank 1's: one core's work)."""
    runs = {}
    for (mistake, _), port in zip(RANK_ERRORS, free_ports(len(RANK_ERRORS)), strict=True):
        tmp_path = tmp_path_factory.mktemp(mistake)
        ckpt = [str(checkpoint_of_another_model(tmp_path))] if mistake == "other" else []
        runs[mistake] = RefusedRun(tmp_path, mistake, *ckpt, port=port)
    yield runs
    for run in runs.values():
        run.end()


@pytest.mark.slow
@pytest.mark.parametrize(("mistake", "message"), RANK_ERRORS)
def test_an_error_in_the_ranks_prints_once_with_the_traceback_of_one_rank(rank_errors, mistake, message):
    code, lines, events = rank_errors[mistake].wait()
    output = "\n".join(lines)
    assert code != 0
    assert "Initializing distributed: GLOBAL_RANK: 1" in output  # the ranks started
    assert "rank 1 started" in events  # what the trace says when they do
    assert events.count("process group") == 2
    said = [i for i, line in enumerate(lines) if re.fullmatch(message + ".*", line)]
    assert len(said) == 1, output[-3000:]
    assert output.count("Traceback (most recent call last)") == 1
    prefix = re.match(message, lines[said[0]])[1]  # the rank that printed it, on every line of its traceback
    start = lines.index(prefix + "Traceback (most recent call last):")
    assert all(line.startswith(prefix) for line in lines[start:said[0] + 1])


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
    from lightning_zoff import training
    from lightning_zoff.placement import PlanDoesNotFit

    def never(*args, **kwargs):
        raise AssertionError("the model must not be sharded (nor its fp32 copies made) when the plan cannot fit")

    monkeypatch.setattr(training, "shard_model", never)  # the forked rank inherits both
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

    def forward(self, x):
        return x * self.g


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
