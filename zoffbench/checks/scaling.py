"""zoff on N devices against zoff on 1 device with the same global batch: losses, per-rank memory, thread layout.

The entry point: scripts/checks/check_scaling.py.

Each side runs in its own subprocess (its own process group): N ranks with a batch of B/N each, then one rank with
a batch of B. A rank's loss is the mean over its own samples, so the mean of the N ranks' losses is comparable
with the single rank's. Prints both per step, the largest relative difference, every rank's memory report (each
should hold 1/N of the master and state) and each rank's cores and threads. tests/gpu/test_check_scaling.py asserts on
`compare`'s summary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from zoffbench.harness import call

if TYPE_CHECKING:  # types only: each side imports Lightning and zoff in its own process
    from lightning.fabric.connector import _PRECISION_INPUT

    from lightning_zoff.trainer import ZoffStrategy

MODEL: dict[str, Any] = dict(vocab_size=256, block_size=256, n_layer=6, n_head=8, n_embd=512, lr=1e-3, weight_decay=0.1)
GLOBAL_BATCH = 16


def run_side(devices: int, steps: int, precision: _PRECISION_INPUT) -> dict:
    """One rank's losses (the mean over its own samples), memory report and thread layout."""
    import lightning.pytorch as pl

    import lightning_zoff  # noqa: F401
    from lightning_zoff.examples.corpus import CorpusDataModule
    from lightning_zoff.examples.gpt import GPTModule
    from zoffbench.recorders import StepRecorder

    pl.seed_everything(0)
    record = StepRecorder()
    data = CorpusDataModule(block_size=MODEL["block_size"], batch_size=GLOBAL_BATCH // devices, max_bytes=4_000_000)
    trainer = pl.Trainer(accelerator="auto", devices=devices, strategy="zoff", precision=precision, max_steps=steps,
                         gradient_clip_val=1.0, callbacks=[record], logger=False, enable_checkpointing=False,
                         limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(GPTModule(**MODEL), datamodule=data)
    zoff = cast("ZoffStrategy", trainer.strategy)  # strategy="zoff"
    assert zoff._cpu_layout is not None  # taken when the rank started, kept after fit
    return {"losses": record.losses, "memory": zoff.memory_report,
            "layout": zoff._cpu_layout.describe(), "device": str(zoff.root_device)}


def compare(devices: int, steps: int, precision: _PRECISION_INPUT = "bf16-mixed") -> dict:
    """The mean loss of `devices` ranks next to one rank's, per step, and every rank's report."""
    many = call(run_side, devices=devices, steps=steps, precision=precision)
    one, = call(run_side, devices=1, steps=steps, precision=precision)
    mean = [sum(r["losses"][i] for r in many) / len(many) for i in range(len(one["losses"]))]
    rel = [abs(m - o) / o for m, o in zip(mean, one["losses"], strict=True)]
    return {"devices": devices, "max_rel_diff": max(rel), "mean_losses": mean, "one_device_losses": one["losses"],
            "rel_diff": rel, "ranks": many, "one_device": one}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--out", type=Path, default=Path("scaling_check.json"))
    args = parser.parse_args()
    summary = compare(args.devices, args.steps, args.precision)
    print(f"{'step':>5} {args.devices:>3} devices (mean) {'1 device':>10} {'rel diff':>9}")
    columns = (summary["mean_losses"], summary["one_device_losses"], summary["rel_diff"])
    for i, (m, o, d) in enumerate(zip(*columns, strict=True)):
        print(f"{i:>5} {m:>19.4f} {o:>10.4f} {d:>9.4f}")
    for r, rank in enumerate(summary["ranks"]):
        print(f"rank {r} ({rank['device']}): {rank['layout']}; master {rank['memory']['host_master'] / 2**20:.1f} MiB,"
              f" state {rank['memory']['host_optimizer_state'] / 2**20:.1f} MiB")
    print(f"1 device: master {summary['one_device']['memory']['host_master'] / 2**20:.1f} MiB")
    print(f"max relative difference of the losses: {summary['max_rel_diff']:.4f}")
    args.out.write_text(json.dumps(summary, indent=1))

