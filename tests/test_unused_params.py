"""Parameters that get no gradient in a window (a branch taken on some steps, an MoE expert no token chose, frozen
weights): zoff updates exactly what torch's AdamW under DDP(find_unused_parameters=True) updates, skips the rest bit
for bit (no moment decay, no weight decay, no step), keeps host state only for what the optimizer trains, and resumes
bit-exact with per-parameter step counts."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import helpers.trainer
from helpers import tiny
from helpers.compare import rel_err
from helpers.resume_run import resume_fit
from helpers.tiny import DIM, VOCAB, token_loader
from helpers.tiny_module import TinyModule
from lightning_zoff import ZoffStrategy

STEPS = 8


class BranchBlock(tiny.Block):
    """A block with an extra branch that runs only while `use_branch` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Linear(DIM, DIM)
        self.use_branch = True

    def forward(self, x):
        x = super().forward(x)
        return x + self.branch(x) if self.use_branch else x


class MoEBlock(tiny.Block):
    """Mixtral's layout: a router picks one of the experts per token; an expert no token picked does not run. The
    last expert is masked out of the router, so no rank ever uses it. The blocks are the units, the experts inside."""

    def __init__(self, experts: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, experts + 1, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
                                     for _ in range(experts + 1))
        self.hits: list[list[int]] = []  # per forward: the experts that got tokens on this rank

    def forward(self, x):
        x = super().forward(x)
        flat = x.reshape(-1, DIM)
        logits = self.router(flat)
        logits[:, -1] = float("-inf")
        weight, choice = F.softmax(logits, dim=-1).max(dim=-1)
        out = torch.zeros_like(flat)
        hits = []
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            hits.append(e)
            out[rows] = expert(flat[rows]) * weight[rows, None]
        self.hits.append(hits)
        return x + out.view_as(x)


class Recorder(pl.Callback):
    """Per rank: losses, the step count of each parameter after each step (what the optimizer state says), and the
    whole model's fp32 weights before training and after each step (rank 0; gathering is a collective)."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.steps: list[dict[str, int]] = []
        self.weights: list[dict[str, torch.Tensor]] = []

    def _weights(self, trainer, pl_module) -> dict[str, torch.Tensor]:
        if isinstance(trainer.strategy, ZoffStrategy):
            return trainer.strategy.full_state_dict()
        return {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def _steps(self, trainer, pl_module) -> dict[str, int]:
        optimizer = trainer.optimizers[0]
        if isinstance(trainer.strategy, ZoffStrategy):
            state = trainer.strategy.optimizer_state(optimizer)["state"]
            return {name: int(s["step"]) for name, s in state.items() if int(s["step"])}  # torch: none before a step
        names = {id(p): n for n, p in pl_module.named_parameters()}
        return {names[id(p)]: int(s["step"]) for p, s in optimizer.state.items() if s}

    def on_train_start(self, trainer, pl_module):
        self.weights.append(self._weights(trainer, pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if len(self.steps) < trainer.global_step:  # a step was taken
            self.steps.append(self._steps(trainer, pl_module))
            self.weights.append(self._weights(trainer, pl_module))

    def on_train_end(self, trainer, pl_module):
        hits = [b.hits for b in pl_module.model.blocks if isinstance(b, MoEBlock)]
        info = {"losses": pl_module.losses, "steps": self.steps, "hits": hits}
        if isinstance(trainer.strategy, ZoffStrategy):
            info["memory"] = trainer.strategy.engine.memory_report()
        if trainer.global_rank == 0:
            info["weights"] = self.weights
        torch.save(info, self.out / f"rank{trainer.global_rank}.pt")


class BranchModule(TinyModule):
    """TinyModule whose middle block has a branch (`inside`) or whose logits pass an adapter, its own unit
    (`own_unit`), used while `uses(batch_idx)` holds."""

    def __init__(self, where: str = "inside", uses=lambda batch_idx: batch_idx % 2 == 0, moe: bool = False,
                 frozen: tuple[str, ...] = ()) -> None:
        super().__init__(step_lr=False)
        self.where, self.uses = where, uses
        if where == "inside":
            self.model.blocks[1] = BranchBlock()
        if moe:
            self.model.blocks = nn.ModuleList(MoEBlock() for _ in self.model.blocks)
        self.adapter = nn.Linear(VOCAB, VOCAB) if where == "own_unit" else None
        for name, p in self.named_parameters():
            if any(name.startswith(prefix) for prefix in frozen):
                p.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        use = self.uses(batch_idx)
        if self.where == "inside":
            self.model.blocks[1].use_branch = use
        x, y = batch
        logits = self.model(x)
        if self.adapter is not None and use:
            logits = logits + self.adapter(logits)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        return loss


def train(out: Path, strategy, make_module, *, accumulate: int = 1, batch_size: int = 4, steps: int = STEPS) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(11)
    helpers.trainer.fit(make_module(), token_loader(batch_size=batch_size), strategy, max_steps=steps,
                        accumulate=accumulate, clip=0.84, callbacks=[Recorder(out)])
    return {rank: torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)}


def ddp():
    return DDPStrategy(start_method="fork", find_unused_parameters=True)


def assert_like_ddp(zoff: dict, ref: dict) -> None:
    for rank in (0, 1):
        assert rel_err(zoff[rank]["losses"], ref[rank]["losses"]) < 1e-5
        assert zoff[rank]["steps"] == ref[rank]["steps"]  # the same parameters stepped, step by step
    for mine, theirs in zip(zoff[0]["weights"], ref[0]["weights"], strict=True):
        for name in theirs:
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-4, atol=1e-6)


def unchanged_while_unused(run: dict, prefix: str, used: list[bool]) -> None:
    """Each step whose window used nothing under `prefix` left those parameters bit for bit as they were."""
    weights = run[0]["weights"]
    names = [n for n in weights[0] if n.startswith(prefix)]
    assert names
    for step, was_used in enumerate(used):
        for name in names:
            same = torch.equal(weights[step + 1][name], weights[step][name])
            assert same != was_used, (name, step, was_used)


@pytest.fixture(scope="module")
def ddp_branch_runs(tmp_path_factory):
    """DDP's run of `BranchModule(where)`, one per `where`, trained once for the zoff runs with and without overlap."""
    runs: dict[str, dict] = {}

    def run(where: str) -> dict:
        if where not in runs:
            runs[where] = train(tmp_path_factory.mktemp(f"ddp_{where}"), ddp(), lambda: BranchModule(where))
        return runs[where]

    return run


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("where", ["inside", "own_unit"])
def test_a_branch_used_on_even_steps_matches_ddp(tmp_path, ddp_branch_runs, where, overlap):
    make = lambda: BranchModule(where)  # noqa: E731
    ref = ddp_branch_runs(where)
    zoff = train(tmp_path / "zoff", ZoffStrategy(start_method="fork", overlap=overlap), make)
    assert_like_ddp(zoff, ref)
    prefix = "model.blocks.1.branch." if where == "inside" else "adapter."
    steps = zoff[0]["steps"][-1]
    assert {n: s for n, s in steps.items() if n.startswith(prefix)} == dict.fromkeys(
        [n for n in steps if n.startswith(prefix)], STEPS // 2)
    assert steps["model.head.weight"] == STEPS
    unchanged_while_unused(zoff, prefix, [step % 2 == 0 for step in range(STEPS)])


def test_a_branch_used_in_one_micro_batch_of_a_window_is_updated(tmp_path):
    # windows of 2 micro-batches: the branch runs in the first micro-batch of every other window only
    make = lambda: BranchModule("inside", uses=lambda batch_idx: batch_idx % 4 == 0)  # noqa: E731
    ref = train(tmp_path / "ddp", ddp(), make, accumulate=2)
    zoff = train(tmp_path / "zoff", ZoffStrategy(start_method="fork"), make, accumulate=2)
    assert_like_ddp(zoff, ref)
    unchanged_while_unused(zoff, "model.blocks.1.branch.", [step % 2 == 0 for step in range(STEPS)])


@pytest.mark.slow
def test_moe_experts_without_tokens_match_ddp(tmp_path):
    make = lambda: BranchModule("none", moe=True)  # noqa: E731
    ref = train(tmp_path / "ddp", ddp(), make, batch_size=1)
    zoff = train(tmp_path / "zoff", ZoffStrategy(start_method="fork"), make, batch_size=1)
    assert_like_ddp(zoff, ref)
    hits = [[set(h) for block in zoff[rank]["hits"] for h in block] for rank in (0, 1)]
    # the cases that matter happened: an expert used on one rank only, and a real one used on no rank at some step
    assert any(a != b for a, b in zip(*hits, strict=True))
    assert any(len(a | b) < 8 for a, b in zip(*hits, strict=True))
    masked = "model.blocks.1.experts.8."
    assert not [n for n in zoff[0]["steps"][-1] if n.startswith(masked)]  # never stepped
    unchanged_while_unused(zoff, masked, [False] * STEPS)


FROZEN = ("model.emb.", "model.blocks.0.", "model.blocks.1.ln1.")  # next to the head in the root unit, a whole
# unit, and inside a unit


def padded(numel_rows: int, rest: int, world: int = 2) -> int:
    return math.ceil(numel_rows / world) * rest


def test_frozen_parameters_keep_their_bits_and_no_host_state(tmp_path):
    make = lambda: BranchModule("none", frozen=FROZEN)  # noqa: E731
    ref = train(tmp_path / "ddp", ddp(), make)
    zoff = train(tmp_path / "zoff", ZoffStrategy(start_method="fork"), make)
    assert_like_ddp(zoff, ref)
    first, last = zoff[0]["weights"][0], zoff[0]["weights"][-1]
    for name in first:
        assert torch.equal(first[name], last[name]) == name.startswith(FROZEN), name
    # host state only for what the optimizer trains: fp32 master and two fp32 moments per padded trainable element
    module = make()
    trainable = sum(padded(p.shape[0], p[0].numel()) for p in module.parameters() if p.requires_grad)
    every = sum(padded(p.shape[0], p[0].numel()) for p in module.parameters())
    memory = zoff[0]["memory"]
    assert memory["host_master"] == 4 * trainable < 4 * every
    assert memory["host_optimizer_state"] == 8 * trainable
    assert memory["trained_params"] < memory["local_params"]


def test_resume_with_parameters_that_stepped_less_is_bit_exact(tmp_path):
    # a checkpoint at step 6 (the epoch's end): the branch has taken 3 steps, the rest 6; resuming must continue each
    # from its own count
    make = lambda: BranchModule("inside")  # noqa: E731
    every6 = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_train_steps=6)
    full = resume_fit(tmp_path / "full", module=make(), callbacks=[every6])
    resumed = resume_fit(tmp_path / "resumed", module=make(), ckpt_path=tmp_path / "ck" / "epoch=0-step=6.ckpt")
    for rank in (0, 1):
        assert len(resumed[rank]["losses"]) == 6
        assert resumed[rank]["losses"] == full[rank]["losses"][6:]
