"""zoff on this machine's accelerator against an fp32 CPU reference (DDP + torch.optim.AdamW), same data and init.

The entry point: scripts/checks/check_reference.py.

Each side runs in its own subprocess (one process group each). Prints the per-step losses side by side, the
largest relative difference, zoff's memory report and the accelerator's peak memory, and writes them as JSON.
tests/gpu/test_check_reference.py asserts on `compare`'s summary.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from zoffbench.harness import call, parse_options

if TYPE_CHECKING:  # types only: each side imports Lightning and zoff in its own process
    from lightning_zoff.trainer import ZoffStrategy

MODEL: dict[str, Any] = dict(vocab_size=256, block_size=256, n_layer=6, n_head=8, n_embd=384, lr=1e-3, weight_decay=0.1)


def run_side(side: str, steps: int, options: dict | None = None) -> dict:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_zoff
    from lightning_zoff.examples.corpus import CorpusDataModule
    from lightning_zoff.examples.gpt import GPTModule
    from zoffbench.recorders import StepRecorder

    pl.seed_everything(0)
    model = GPTModule(**MODEL)
    data = CorpusDataModule(block_size=MODEL["block_size"], batch_size=16, max_bytes=4_000_000)
    losses = StepRecorder()
    if side == "reference":
        kwargs: dict[str, Any] = dict(accelerator="cpu", devices=1, strategy=DDPStrategy(), precision="32-true")
    else:
        accel = "gpu" if torch.cuda.is_available() else "cpu"
        kwargs = dict(accelerator=accel, devices=1, strategy=lightning_zoff.ZoffStrategy(**(options or {})),
                      precision="bf16-mixed")
    trainer = pl.Trainer(max_steps=steps, gradient_clip_val=1.0, callbacks=[losses], logger=False,
                         enable_checkpointing=False, limit_val_batches=0, enable_progress_bar=False, **kwargs)
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    result = {"side": side, "device": str(trainer.strategy.root_device), "losses": losses.losses,
              "seconds": time.perf_counter() - start}
    if side == "zoff":
        result["memory"] = cast("ZoffStrategy", trainer.strategy).memory_report
        if torch.cuda.is_available():
            result["cuda_peak_allocated"] = torch.cuda.max_memory_allocated()
            result["num_params"] = sum(p.numel() for p in model.parameters())
    return result


def compare(steps: int, options: dict | None = None) -> dict:
    """Both sides' losses, their largest relative difference, the timings and zoff's memory; `options`: zoff's."""
    sides = {side: call(run_side, side=side, steps=steps, options=options)[0] for side in ("reference", "zoff")}
    ref, zoff = sides["reference"]["losses"], sides["zoff"]["losses"]
    rel = [abs(z - r) / r for r, z in zip(ref, zoff, strict=True)]
    return {
        "max_rel_diff": max(rel), "mean_rel_diff_last10": sum(rel[-10:]) / len(rel[-10:]),
        "reference_seconds": sides["reference"]["seconds"], "zoff_seconds": sides["zoff"]["seconds"],
        "zoff_memory": sides["zoff"]["memory"], "cuda_peak_allocated": sides["zoff"].get("cuda_peak_allocated"),
        "num_params": sides["zoff"].get("num_params"), "model": MODEL, "reference": ref, "zoff": zoff,
        "rel_diff": rel, "device": sides["zoff"]["device"], "zoff_options": options or {},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("ref_check.json"))
    parser.add_argument("--option", action="append", default=[], help="ZoffStrategy option key=value (repeatable)")
    args = parser.parse_args()
    summary = compare(args.steps, parse_options(args.option))
    ref, zoff, rel = summary["reference"], summary["zoff"], summary["rel_diff"]
    zoff_column = f"zoff bf16-mixed ({summary['device']})"
    print(f"{'step':>5} {'reference fp32 (cpu)':>22} {zoff_column:>26} {'rel diff':>9}")
    for i, (r, z, d) in enumerate(zip(ref, zoff, rel, strict=True)):
        if i % max(1, len(ref) // 20) == 0 or i == len(ref) - 1:
            print(f"{i:>5} {r:>22.4f} {z:>26.4f} {d:>9.4f}")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("reference", "zoff", "rel_diff")}, indent=1))
    args.out.write_text(json.dumps(summary, indent=1))

