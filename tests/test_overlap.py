"""The overlapped engine (speculative updates during backward, finalized on a worker thread) gives the same bits as
the synchronous path: with clipping active on some steps only, an overflow that skips one step, fp16 loss scaling,
and gradient accumulation on the host or the accelerator."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import helpers.trainer
from helpers.tiny import SEQ, VOCAB, token_loader
from helpers.tiny_module import TinyModule
from lightning_zoff import ZoffPrecision, ZoffStrategy
from lightning_zoff.examples.gpt import GPTModule
from lightning_zoff.placement.plan import RING_UNITS

pytestmark = pytest.mark.slow  # a test trains several times on 2 ranks, over a second each

STEPS, BAD_STEP = 20, 7
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class PoisonOneStep(TinyModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.trainer.global_step == BAD_STEP else loss


class Record(pl.Callback):
    """Per rank: the micro-batch losses, every step's outcome and speculation counts, and the final state."""

    def __init__(self, out: Path, await_speculation: bool):
        self.out, self.await_speculation = out, await_speculation
        self.outcomes = []
        self.first_step_speculations = None

    def on_train_start(self, trainer, pl_module):
        scheduler = trainer.strategy.engine.scheduler  # None without overlap
        if scheduler is not None:
            scheduler.await_speculation = self.await_speculation

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        last = trainer.strategy.last_step
        if last is not None and len(self.outcomes) < trainer.global_step:
            self.outcomes.append([last.skipped, last.clip_coef, last.grad_norm])
            scheduler = trainer.strategy.engine.scheduler
            if len(self.outcomes) == 1 and scheduler is not None:
                trainer.strategy.engine.wait_idle()
                self.first_step_speculations = dict(scheduler.speculations)

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.engine
        engine.wait_idle()
        state = {f"{i}.{k}": t.clone() for i, u in enumerate(engine.units)
                 for k, t in (("master", u.master), ("m", u.moments["exp_avg"]), ("v", u.moments["exp_avg_sq"]))}
        state |= {n: p.to_local().detach().clone() for n, p in pl_module.named_parameters()}
        torch.save({"losses": pl_module.losses, "outcomes": self.outcomes, "state": state,
                    "steps": [p.step for u in engine.units for p in u.trained],
                    "speculations": dict(engine.scheduler.speculations) if engine.scheduler else None,
                    "first_step_speculations": self.first_step_speculations,
                    "scale": trainer.precision_plugin.loss_scale},
                   self.out / f"rank{trainer.global_rank}.pt")


def run(out: Path, *, overlap: bool, await_speculation: bool = False, accumulate: int = 1, where: str = "host",
        moments: str = "fp32", clip: float | None = None, ring_units: int = 3):
    # norms run about 0.83-1.0 with one micro-batch and 0.74-0.87 with two: clip inside that range
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(3)
    helpers.trainer.fit(
        PoisonOneStep(), token_loader(n=2 * 2 * 4 * STEPS * accumulate),
        ZoffStrategy(start_method="fork", overlap=overlap, grad_accum_on=where, optimizer_state_dtype=moments,
                     staging_ring_units=ring_units),
        plugins=[ZoffPrecision("16-mixed", scale=2.0**10, hysteresis=1)], max_steps=STEPS, accumulate=accumulate,
        clip=clip or (0.9 if accumulate == 1 else 0.81), callbacks=[Record(out, await_speculation)])
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


def assert_same_bits(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]  # floats compared exactly
    assert repr(a["outcomes"]) == repr(b["outcomes"])  # repr: exact for floats, and NaN equals NaN
    assert a["steps"] == b["steps"]
    assert a["scale"] == b["scale"]
    assert a["state"].keys() == b["state"].keys()
    for name, tensor in a["state"].items():
        assert torch.equal(tensor.view(torch.uint8), b["state"][name].view(torch.uint8)), name


@pytest.mark.parametrize(("accumulate", "where", "moments"), [(1, "host", "fp32"), (2, "host", "fp32"),
                                                       (2, "accelerator", "fp32"), (2, "host", "bf16")])
def test_overlap_equals_synchronous_bitwise(tmp_path, accumulate, where, moments):
    sync = run(tmp_path / "sync", overlap=False, accumulate=accumulate, where=where, moments=moments)
    outcomes = sync[0]["outcomes"]
    assert len(outcomes) == STEPS
    assert [skipped for skipped, *_ in outcomes] == [i == BAD_STEP for i in range(STEPS)]
    clipped = [coef < 1.0 for skipped, coef, _ in outcomes if not skipped]
    assert any(clipped)
    assert not all(clipped)  # clipping active on some steps only: both speculation outcomes
    # every unit with a spare set from the pool speculated before the decision: kept on unclipped steps, redone (in
    # place) on clipped ones, dropped on the skip
    awaited = run(tmp_path / "awaited", overlap=True, await_speculation=True, accumulate=accumulate, where=where,
                  moments=moments)
    for rank in (0, 1):
        assert_same_bits(awaited[rank], sync[rank])
        units = len(awaited[rank]["steps"]) and awaited[rank]["speculations"]
        assert units["kept"] > 0
        assert units["redone"] > 0
    assert sync[0]["speculations"] is None  # no scheduler: nothing speculates
    assert {sync[0]["state"]["0.m"].dtype, awaited[0]["state"]["0.v"].dtype} == {DTYPES[moments]}
    if accumulate == 1:  # and with the worker's natural timing
        natural = run(tmp_path / "natural", overlap=True, accumulate=accumulate, where=where)
        for rank in (0, 1):
            assert_same_bits(natural[rank], sync[rank])


def test_any_staging_ring_gives_the_synchronous_bits(tmp_path):
    # windows of two summed on the host, the worker's own timing: a ring of one unit's landing (backward waits for
    # each sum before landing the next shard) and none (a landing buffer per host unit)
    sync = run(tmp_path / "sync", overlap=False, accumulate=2)
    for units in (1, 0):
        ringed = run(tmp_path / f"ring{units}", overlap=True, accumulate=2, ring_units=units)
        for rank in (0, 1):
            assert_same_bits(ringed[rank], sync[rank])


def test_overlap_equals_synchronous_when_every_step_is_clipped(tmp_path):
    # as Qwen3-4B at initialization: no speculation is ever kept, every update runs after the decision
    sync = run(tmp_path / "sync", overlap=False, clip=0.05)
    assert all(coef < 1.0 for skipped, coef, _ in sync[0]["outcomes"] if not skipped)
    awaited = run(tmp_path / "awaited", overlap=True, await_speculation=True, clip=0.05)
    natural = run(tmp_path / "natural", overlap=True, clip=0.05)
    for rank in (0, 1):
        assert_same_bits(awaited[rank], sync[rank])
        assert_same_bits(natural[rank], sync[rank])
        assert awaited[rank]["speculations"]["kept"] == 0
        assert awaited[rank]["speculations"]["redone"] > 0
        # with the worker's own timing, once a step was clipped the next windows wait for the decision instead
        assert natural[rank]["speculations"]["kept"] == 0
        assert natural[rank]["speculations"]["redone"] == natural[rank]["first_step_speculations"]["redone"]


class MemoryReport(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.engine
        engine.wait_idle()
        report = {**engine.memory_report(), "held": engine.held_bytes(), "planned_host": engine.plan.host_bytes}
        torch.save(report, self.out / f"memory{trainer.global_rank}.pt")


def fit_deep_gpt(out: Path, accumulate: int = 1, **options) -> list[dict]:
    # a GPT's shape: 24 equal blocks and a root unit (embeddings, final norm, head); a bf16 model, fp32 moments,
    # overlap on
    out.mkdir()
    module = GPTModule(vocab_size=VOCAB, block_size=SEQ, n_layer=24, n_head=2, n_embd=32, bias=False)
    helpers.trainer.fit(module, token_loader(n=16 * accumulate), ZoffStrategy(start_method="fork", **options),
                        precision="bf16-true", max_steps=2, accumulate=accumulate, callbacks=[MemoryReport(out)])
    return [torch.load(out / f"memory{rank}.pt") for rank in (0, 1)]


def test_windows_summed_on_the_host_land_in_one_staging_ring(tmp_path):
    """With windows of two micro-batches and `staging_ring_units` set the host units keep an fp32 sum each and no
    landing buffer of their own: one ring of that many of the largest unit's landings (a block's) serves them, and the
    engine holds what the plan says; 0, a landing buffer per host unit again."""
    single = fit_deep_gpt(tmp_path / "single")
    # a block's: LayerNorms 2 x 32, qkv 96 x 32, proj 32 x 32, fc 128 x 32, proj 32 x 128 elements, this rank's half of
    # them in 16 bits
    block = 2 * (2 * 32 + 96 * 32 + 32 * 32 + 128 * 32 + 32 * 128) // 2
    for units in (3, 5, 0):
        summed = fit_deep_gpt(tmp_path / f"ring{units}", accumulate=2, staging_ring_units=units)
        for one, two in zip(single, summed, strict=True):
            assert two["held"]["host"] == two["planned_host"] == two["host_total"]
            landings = one["host_staging"]  # every unit's own 16-bit landing, with accumulate 1
            assert two["host_staging"] == (units * block if units else landings)
            assert units * block < landings
            assert two["host_grad_sum"] == 2 * landings  # fp32 sums of the same elements


def test_the_staging_ring_by_default_only_where_a_landing_buffer_per_unit_does_not_fit(tmp_path, monkeypatch, said):
    """`staging_ring_units="auto"`: a landing buffer per host unit where the plan fits with them (backward never
    waits for landing room), else the ring of RING_UNITS, where it lets the plan fit."""
    apart = fit_deep_gpt(tmp_path / "apart", accumulate=2, staging_ring_units=0)
    ringed = fit_deep_gpt(tmp_path / "ringed", accumulate=2, staging_ring_units=RING_UNITS)
    roomy = fit_deep_gpt(tmp_path / "roomy", accumulate=2)
    for memory, own in zip(roomy, apart, strict=True):
        assert memory["host_staging"] == own["host_staging"]
        assert memory["held"]["host"] == memory["planned_host"] == memory["host_total"]
    ring_lines = [line.split(";")[0] for line in said.lines if "staging ring" in line]
    named = (f"host: gradient shards land in a staging ring of {RING_UNITS} units' landings"
             f" ({ringed[0]['host_staging'] / 1e6:.1f} MB: `staging_ring_units`)")
    assert ring_lines == [named]  # the run that named it; "auto" took none on this host
    # a host that holds the state with the ring and no spare set, but not with a landing buffer per unit
    without_spares = [m["host_total"] - m["host_spare_state"] for m in (apart[0], ringed[0])]
    assert without_spares[1] < without_spares[0]
    monkeypatch.setenv("ZOFF_HOST_MEMORY_BYTES", str(2 * (2**28 + sum(without_spares) // 2)))
    tight = fit_deep_gpt(tmp_path / "tight", accumulate=2)
    for memory, ring in zip(tight, ringed, strict=True):
        assert memory["host_staging"] == ring["host_staging"]
        assert memory["held"]["host"] == memory["planned_host"] == memory["host_total"]
    assert "a landing buffer per unit does not fit" in [line for line in said.lines if "staging ring" in line][-1]


def test_overlap_takes_as_many_spare_sets_as_the_host_has_room_for(tmp_path, monkeypatch):
    roomy = fit_deep_gpt(tmp_path / "roomy")
    for memory in roomy:
        assert memory["spare_sets"] == 12  # one per two of the 24 blocks: plenty of memory here
        assert memory["held"]["host"] == memory["planned_host"] == memory["host_total"]
    # a host with room for the state and two and a half sets on each rank (beyond the 256 MiB kept for the process)
    state = roomy[0]["host_total"] - roomy[0]["host_spare_state"]
    set_bytes = roomy[0]["host_spare_state"] // 12
    # a block's state (12 B) and 16-bit copy (2 B) per element of its half: LayerNorms 2 x 16, qkv 48 x 32, proj
    # 16 x 32, fc 64 x 32, proj 16 x 128
    assert set_bytes == 14 * (2 * 16 + 48 * 32 + 16 * 32 + 64 * 32 + 16 * 128)
    monkeypatch.setenv("ZOFF_HOST_MEMORY_BYTES", str(2 * (2**28 + state + set_bytes * 5 // 2)))
    tight = fit_deep_gpt(tmp_path / "tight")
    for memory in tight:
        assert memory["spare_sets"] == 2
        assert memory["host_spare_state"] == 2 * set_bytes
        assert memory["held"]["host"] == memory["planned_host"] == state + 2 * set_bytes <= memory["host_capacity"]
