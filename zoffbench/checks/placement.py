"""Optimizer state kept on the GPU against all of it on the host, on this machine's accelerator.

The entry point: scripts/checks/check_placement.py.

Trains the example GPT in 32-true (clipping on) with `accelerator_state` "none", 0.5, 1.0 and "auto", each in its own
subprocess, and compares every loss with the all-host run's (the GPU's torch AdamW and the host's kernel round alike
but not identically: within 1e-5). Records where each run kept its units' state: "auto" must have moved units to the
GPU after the first step. Exits non-zero when a run strays. tests/gpu/test_check_placement.py asserts on `compare`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Literal, cast

from zoffbench.harness import call_each

MODEL: dict[str, Any] = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256, lr=3e-3, weight_decay=0.1)
MODES: dict[str, Literal["auto", "none"] | float] = {"none": "none", "half": 0.5, "all": 1.0, "auto": "auto"}


def run_mode(mode: str, steps: int, accumulate: int) -> dict:
    import lightning.pytorch as pl

    from lightning_zoff.examples.corpus import CorpusDataModule
    from lightning_zoff.examples.gpt import GPTModule
    from lightning_zoff.trainer import ZoffStrategy  # the door's module: lightning_zoff's lazy name is Any to mypy
    from zoffbench.recorders import StepRecorder

    pl.seed_everything(0)
    record = StepRecorder()
    trainer = pl.Trainer(
        accelerator="auto", devices=1, strategy=ZoffStrategy(accelerator_state=MODES[mode]), precision="32-true",
        max_steps=steps, accumulate_grad_batches=accumulate, gradient_clip_val=1.0, callbacks=[record], logger=False,
        enable_checkpointing=False, limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(GPTModule(**MODEL), datamodule=CorpusDataModule(block_size=MODEL["block_size"], batch_size=8,
                                                                 max_bytes=2_000_000))
    engine = cast(ZoffStrategy, trainer.strategy).engine
    assert engine is not None  # teardown only detaches it
    return {"losses": record.losses, "placement": engine.placement_summary(),
            "device": str(trainer.strategy.root_device)}


def compare(steps: int, accumulate: int = 1) -> dict:
    runs = call_each(run_mode, {mode: dict(mode=mode, steps=steps, accumulate=accumulate) for mode in MODES})
    results = {mode: ranks[0] for mode, ranks in runs.items()}
    reference = results["none"]["losses"]
    summary: dict = {"device": results["none"]["device"], "steps": steps, "accumulate": accumulate}
    for mode, result in results.items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], reference, strict=True))
        summary[mode] = {"max_rel_loss_diff_vs_host": worst, "placement": result["placement"]}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("placement_check.json"))
    args = parser.parse_args()
    summary = compare(args.steps, args.accumulate)
    print(json.dumps(summary, indent=1))
    args.out.write_text(json.dumps(summary, indent=1))
    ok = all(summary[mode]["max_rel_loss_diff_vs_host"] < 1e-5 for mode in MODES)
    sys.exit(0 if ok and summary["auto"]["placement"]["accelerator"][0] > 0 else 1)

