"""LitGPT's own `pretrain.py` (`litgpt.pretrain.main`, LitGPT's code) under
`Fabric(strategy=ZoffFabricStrategy(state_dict_type="full"))`, the one line its `setup` would change, against the same
under Fabric's DDP: 2 forked CPU ranks, fp32, accumulation over 2 micro-batches, continued pretraining from a tiny
checkpoint made here (`--initial_checkpoint_dir`, so both runs start from the same weights) on token windows made here
(no litdata).

What it takes of zoff: `fabric.init_module(empty_init=True)` and LitGPT's `initialize_weights`, `torch.compile(model)`
before `fabric.setup` (Fabric compiles the sharded model again), `fabric.load_raw`, the learning rate written into the
param groups each iteration, `fabric.clip_gradients`, the throughput monitor, `fabric.save` of its state (model,
optimizer, loader, counters) every 2 steps and at the end, `fabric.load` of it to resume; and the final checkpoint
read by LitGPT's own `generate`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from litgpt import pretrain
from litgpt.args import EvalArgs, TrainArgs
from litgpt.data import DataModule
from litgpt.generate import base as generate
from torch.utils.data import DataLoader

from helpers.litgpt_files import VOCAB, checkpoint_dir, config, relative_difference, run_litgpt
from lightning_zoff import ZoffFabricStrategy

pytestmark = pytest.mark.slow  # LitGPT's script twice per strategy, and torch.compile's first compilation (~40 s)


class Resumable(DataLoader):
    """A loader whose state is how far into its batches it is, as LitGPT's own (litdata's) loaders keep: `fabric.save`
    stores it with the run's state and `fabric.load` puts it back (a plain DataLoader would be pickled whole)."""

    position = skip = 0

    def __iter__(self):
        for i, batch in enumerate(super().__iter__()):
            if i >= self.skip:
                self.position = i + 1
                yield batch
        self.position = self.skip = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["position"]


class Counting(DataModule):
    """Token windows that count up from a start by a step of their own (mod the vocabulary): learnt in a few steps."""

    def connect(self, tokenizer=None, batch_size=1, max_seq_length=None, **kwargs):
        self.batch_size, self.length = batch_size, max_seq_length + 1  # inputs and their next tokens

    def train_dataloader(self) -> DataLoader:
        return self._windows(64, seed=0)

    def val_dataloader(self) -> DataLoader:
        return self._windows(8, seed=1)

    def _windows(self, rows: int, seed: int) -> DataLoader:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (rows, 1), generator=generator)
        step = torch.randint(1, 4, (rows, 1), generator=generator)
        return Resumable((start + step * torch.arange(self.length)) % VOCAB, batch_size=self.batch_size)


def train(fabric: Fabric, base: str, out: str, resume: str | None) -> list[float]:
    """LitGPT's `main` as its `setup` launches it: 4 optimizer steps of 2 micro-batches of 2 windows per rank (the
    token budget), saved every 2 steps; from the saved state `resume` if given."""
    args = TrainArgs(save_interval=2, log_interval=1, global_batch_size=8, micro_batch_size=2, max_tokens=1024,
                     max_norm=1.0, min_lr=1e-3, lr_warmup_steps=1, max_seq_length=32)
    evaluation = EvalArgs(interval=1000, max_iters=2, initial_validation=False, final_validation=False)
    optimizer = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}}
    initial = None if resume else Path(base)
    return run_litgpt(fabric, pretrain.main, 2, 42, initial, Path(resume) if resume else False, config(),
                      Counting(), Path(out), Path(base), None, args, evaluation, optimizer)


def fabric(name: str) -> Fabric:
    strategy = ZoffFabricStrategy(start_method="fork", state_dict_type="full") if name == "zoff" else "ddp_fork"
    return Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")


def generated(final: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The tokens LitGPT's `generate` (its `main`, as `litgpt generate` runs it) gives for a prompt, greedily, from the
    checkpoint directory `final` (the tiny tokenizer cannot spell most of them)."""
    tokens: list[int] = []

    def recorded(*args, **kwargs):
        out = generate_tokens(*args, **kwargs)
        tokens.extend(out.tolist())
        return out

    generate_tokens = generate.generate
    monkeypatch.setattr(generate, "generate", recorded)
    generate.main(final, prompt="red green blue", max_new_tokens=8, top_k=1, precision="32-true")
    monkeypatch.setattr(generate, "generate", generate_tokens)
    return tokens


def test_litgpts_pretrain_runs_with_its_strategy_line_changed(tmp_path, monkeypatch):
    base = checkpoint_dir(tmp_path)  # weights, and the tokenizer its `--tokenizer_dir` copies next to each save
    monkeypatch.setattr(sys, "argv", ["litgpt", "pretrain", "pythia-14m", f"--tokenizer_dir={base}"])  # LitGPT's CLI
    runs, resumed = {}, {}
    for name in ("ddp", "zoff"):
        runs[name] = fabric(name).launch(train, str(base), str(tmp_path / name), None)
        # from the state saved after step 2 (model, optimizer, loader, counters): steps 3 and 4 as if never stopped
        saved = tmp_path / name / "step-00000002" / "lit_model.pth"
        resumed[name] = fabric(name).launch(train, str(base), str(tmp_path / f"{name}-resumed"), str(saved))
    assert len(runs["zoff"]) == len(runs["ddp"]) == 4
    assert len(resumed["zoff"]) == len(resumed["ddp"]) == 2
    assert relative_difference(runs["zoff"], runs["ddp"]) < 1e-5
    assert relative_difference(resumed["zoff"], runs["zoff"][2:]) < 1e-5
    assert relative_difference(resumed["ddp"], runs["ddp"][2:]) < 1e-5
    assert runs["zoff"][-1] < runs["zoff"][0] - 0.5  # it learns, so the comparison means something
    # the final checkpoint, one file, loads in LitGPT's generate and gives what DDP's gives
    said = {name: generated(tmp_path / name / "final", monkeypatch) for name in runs}
    assert said["zoff"] == said["ddp"]
    assert len(said["zoff"]) == 3 + 8  # the prompt's words, then the new tokens
