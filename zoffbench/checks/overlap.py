"""The overlapped engine against the synchronous one on this machine's accelerator: same bits, or it fails.

The entry point: scripts/checks/check_overlap.py.

Trains the example GPT (bf16-mixed, clipping at a norm that some steps exceed, one step poisoned with inf so it is
skipped) with `ZoffStrategy(overlap=False)` (every update on the host), then `overlap=True` with the worker's natural
timing, with every speculation run before the decision, and with every host update run by the accelerator
(`accelerator_update_share=1.0`), each in its own subprocess (side by side), and compares losses, step outcomes and the
final fp32 masters bit for bit. Exits non-zero on any difference. tests/gpu/test_check_overlap.py asserts on
`compare`'s summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, cast

from zoffbench.harness import call, call_each

MODEL: dict[str, Any] = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256, lr=3e-3, weight_decay=0.1)
BAD_STEP = 5
# every unit's state on the host, where the overlap is ("auto" would place this small model's on the GPU); the
# synchronous run updates every unit on the host, the overlapped ones let the GPU take its measured share ("auto"),
# and "lent" gives the GPU every host update: all must give the synchronous run's bits
MODES: dict[str, dict[str, Any]] = {
    "sync": dict(overlap=False, accelerator_state="none", accelerator_update_share="none"),
    "overlap": dict(overlap=True, accelerator_state="none"),
    "overlap_awaited": dict(overlap=True, accelerator_state="none"),
    "lent": dict(overlap=True, accelerator_state="none", accelerator_update_share=1.0),
}
OVERLAPPED = ("overlap", "overlap_awaited", "lent")  # each compared with sync


def run_mode(mode: str, steps: int, clip: float, accumulate: int) -> dict:
    import lightning.pytorch as pl
    import torch

    from lightning_zoff.examples.corpus import CorpusDataModule
    from lightning_zoff.examples.gpt import GPTModule
    from lightning_zoff.trainer import ZoffStrategy  # the door's module: lightning_zoff's lazy name is Any to mypy
    from zoffbench.recorders import StepRecorder

    class Poisoned(GPTModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if self.trainer.global_step == BAD_STEP else loss

    class Record(StepRecorder):
        """Each batch's loss, and each optimizer step's outcome: [skipped, clip coefficient, gradient norm]."""

        def __init__(self):
            super().__init__()
            self.outcomes = []
            self.speculations = None  # read at the end of training: None says it was not, not that none was kept
            self.spare_sets = None
            self.lent_units = 0

        def on_train_start(self, trainer, pl_module):
            scheduler = trainer.strategy.engine.scheduler  # None without overlap
            if scheduler is not None:
                scheduler.await_speculation = mode == "overlap_awaited"

        def on_train_end(self, trainer, pl_module):
            # read before the fit's teardown: the engine detaches then and its scheduler goes with the counts
            engine = trainer.strategy.engine
            self.spare_sets = int(engine.memory_report()["spare_sets"])
            if engine.scheduler is not None:
                engine.scheduler.wait_idle()
                self.speculations = dict(engine.scheduler.speculations)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            last = trainer.strategy.last_step
            if last is not None and len(self.outcomes) < trainer.global_step:
                self.outcomes.append([last.skipped, last.clip_coef, last.grad_norm])
                self.lent_units += int(trainer.strategy.telemetry.get("zoff/lent_units", 0))

    pl.seed_everything(0)
    record = Record()
    trainer = pl.Trainer(
        accelerator="auto", devices=1, strategy=ZoffStrategy(**MODES[mode]), precision="bf16-mixed",
        max_steps=steps, accumulate_grad_batches=accumulate, gradient_clip_val=clip, callbacks=[record], logger=False,
        enable_checkpointing=False, limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Poisoned(**MODEL), datamodule=CorpusDataModule(block_size=MODEL["block_size"], batch_size=8,
                                                               max_bytes=2_000_000))
    engine = cast(ZoffStrategy, trainer.strategy).engine
    assert engine is not None  # teardown only detaches it
    engine.wait_idle()
    masters = torch.cat([u.master for u in engine.units])
    return {"losses": record.losses, "outcomes": record.outcomes, "masters": masters,
            "speculations": record.speculations, "spare_sets": record.spare_sets, "lent_units": record.lent_units,
            "device": str(trainer.strategy.root_device)}


def first_difference(a: list, b: list) -> int | None:
    """The first index where `a` and `b` differ (a shorter list differs where it ends); None where they are equal."""
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or repr(a[i]) != repr(b[i]):
            return i
    return None


def differences(sync: dict, other: dict) -> dict:
    """Where `other` leaves the synchronous run's bits, so a failure says where to look: the first batch whose loss
    differs, the first step whose outcome differs, and the masters' largest difference. Empty: the same bits."""
    import torch

    found: dict = {}
    loss_at = first_difference(sync["losses"], other["losses"])
    if loss_at is not None:
        found["first_loss_batch"] = loss_at
    outcome_at = first_difference(sync["outcomes"], other["outcomes"])
    if outcome_at is not None:
        found["first_outcome_step"] = outcome_at
        found["outcomes"] = {"sync": sync["outcomes"][outcome_at:outcome_at + 2],
                             "this": other["outcomes"][outcome_at:outcome_at + 2]}
    mine, theirs = other["masters"], sync["masters"]
    if not torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)):
        found["masters_max_abs_diff"] = float((mine - theirs).abs().max())
        found["masters_elements_differing"] = int((mine != theirs).sum())
    return found


def compare(steps: int, clip: float | None = None, accumulate: int = 1) -> dict:
    """The run's setting (steps skipped and clipped) and, per overlapped mode, whether it equals sync bit for bit.
    `clip=None`: the median gradient norm of an unclipped run, so that some steps are clipped and some are not."""
    if clip is None:
        unclipped = call(run_mode, mode="sync", steps=steps, clip=0.0, accumulate=accumulate)[0]
        norms = sorted(norm for skipped, _, norm in unclipped["outcomes"] if not skipped)
        clip = norms[len(norms) // 2]
    runs = call_each(run_mode, {mode: dict(mode=mode, steps=steps, clip=clip, accumulate=accumulate) for mode in MODES})
    results = {mode: ranks[0] for mode, ranks in runs.items()}
    sync = results["sync"]
    clipped = [coef < 1.0 for skipped, coef, _ in sync["outcomes"] if not skipped]
    summary = {"device": sync["device"], "steps": steps, "accumulate": accumulate, "clip": clip,
               "skipped_steps": [i for i, o in enumerate(sync["outcomes"]) if o[0]],
               "clipped_steps": sum(clipped), "unclipped_steps": len(clipped) - sum(clipped)}
    for mode in OVERLAPPED:
        other = results[mode]
        differs = differences(sync, other)
        summary[mode] = {"bitwise_equal_to_sync": not differs, "differs": differs,
                         "speculations": other["speculations"], "spare_sets": other["spare_sets"],
                         "lent_units": other["lent_units"]}
    summary["sync"] = {"lent_units": sync["lent_units"]}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--clip", type=float, default=None, help="default: the median norm of an unclipped run")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("overlap_check.json"))
    args = parser.parse_args()
    summary = compare(args.steps, args.clip, args.accumulate)
    print(json.dumps(summary, indent=1))
    args.out.write_text(json.dumps(summary, indent=1))
    sys.exit(0 if all(summary[mode]["bitwise_equal_to_sync"] for mode in OVERLAPPED) else 1)

