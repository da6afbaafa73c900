"""A step that does not fit the GPU under activation_checkpointing_policy="auto": the GPU could hold all of a 1.34B
GPT's state, but batch 48 of 1024 tokens keeps about 84 GB of activations without recompute, 11 GB with (2.08 and
0.57 GB a sample in bf16, measured on 1x H100, 2026-12-06). The plan traces the step at setup (107.2 GB traced
without recompute, 24.9 with, 1x H100) and recomputes from the start, in one line, the first blocks that let all the
state fit beside the step (the state, 19 GB, fits the GPU). Where the step cannot be traced, the
first forward runs out of CUDA memory; zoff then recomputes the blocks, says so in one line, and runs the batch again.
Either way the run trains as one that named the blocks from the start. The GPU is held to 76 GiB (a per-process
memory fraction, which the plan reads) so that an H200 runs out where an H100 does."""

from __future__ import annotations

import logging
import re

import lightning.pytorch as pl
import pytest
import torch

from lightning_zoff import ZoffStrategy
from lightning_zoff.examples.corpus import SyntheticDataModule
from lightning_zoff.examples.gpt import Block, GPTModule
from lightning_zoff.trainer import strategy as strategy_module

SHAPE = dict(vocab_size=32000, block_size=1024, n_layer=24, n_head=16, n_embd=2048, bias=False)  # conf/model/gpt_1b
GPU_GIB = 76  # an H100's 80 GB less what its driver keeps


@pytest.fixture(autouse=True)
def gpu_of_an_h100():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, GPU_GIB * 2**30 / total), 0)
    yield
    torch.cuda.set_per_process_memory_fraction(1.0, 0)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def train(policy) -> list[float]:
    pl.seed_everything(0)
    losses = Losses()
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=3, gradient_clip_val=1.0,
                         strategy=ZoffStrategy(activation_checkpointing_policy=policy), callbacks=[losses],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with trainer.init_module(empty_init=True):
        module = GPTModule(**SHAPE)
    data = SyntheticDataModule(vocab_size=SHAPE["vocab_size"], block_size=SHAPE["block_size"], batch_size=48,
                               num_samples=144)
    trainer.fit(module, datamodule=data)
    torch.cuda.empty_cache()
    return losses.losses


def recomputing_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "recomputing" in r.getMessage()]


def test_the_plan_recomputes_at_setup_a_step_it_traced_too_large(caplog):
    with caplog.at_level(logging.INFO, logger="lightning_zoff"):
        planned = train("auto")
    said = recomputing_lines(caplog)
    assert len(said) == 1, said
    assert re.match(r"zoff rank 0: recomputing the first \d+ of 24 Block blocks' activations \('auto'\): the step at a"
                    r" batch of 48 x 1024 needs", said[0]), said
    named = train({Block})
    assert len(planned) == len(named) == 3
    torch.testing.assert_close(torch.tensor(planned), torch.tensor(named), rtol=2e-3, atol=0)


def test_a_first_step_out_of_gpu_memory_turns_recompute_on_and_runs_again(caplog, monkeypatch):
    # a step the plan could not trace (the fallback for one that reads values on the host, or an iterable dataset)
    monkeypatch.setattr(strategy_module, "step_probe", lambda *_: None)
    with caplog.at_level(logging.INFO, logger="lightning_zoff"):
        recovered = train("auto")
    said = recomputing_lines(caplog)
    assert len(said) == 1, said
    assert "ran out of GPU memory" in said[0], said
    assert "Block" in said[0], said
    named = train({Block})
    assert len(recovered) == len(named) == 3
    torch.testing.assert_close(torch.tensor(recovered), torch.tensor(named), rtol=2e-3, atol=0)
