"""The largest model this host can train with zoff: build it on the meta device, train N steps on the corpus, report.

    python scripts/checks/check_capacity.py --model gpt7b --steps 20 --option optimizer_state_dtype=bf16 \
        --option overlap=False --out capacity.json
    python scripts/checks/check_capacity.py --model gpt7b --train-last 2 --steps 10   # fine-tune the last 2 blocks only

One process per device (`--devices`, ranks of one node; the CPU with gloo where there is no accelerator). The model
is built under `trainer.init_module(empty_init=True)`, so no process ever holds it whole; zoff materialises one unit
at a time. Prints per-step loss and time, then peak GPU memory, peak host RSS (rank 0's process; the node holds about
`--devices` times that) and zoff's host bytes per parameter, and writes them to `--out`. Exits non-zero unless the
loss fell (the mean of the last quarter of the steps below the mean of the first quarter).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from zoffbench.harness import parse_options
from zoffbench.model_shapes import MODEL_NAMES, model_shape

GPTS = [name for name in MODEL_NAMES if "hf" not in model_shape(name)]  # the example GPT's shapes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=GPTS, default="gpt7b")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="per device")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--precision", default=None, help="default: bf16-mixed on GPU, 32-true on CPU")
    parser.add_argument("--option", action="append", default=[], help="ZoffStrategy option key=value (repeatable)")
    parser.add_argument("--train-last", type=int, default=None,
                        help="freeze all but the last N blocks and the head (a fine-tune: host state for those only)")
    parser.add_argument("--out", type=Path, default=Path("capacity.json"))
    args = parser.parse_args()

    import lightning.pytorch as pl
    import torch

    from lightning_zoff import ZoffStrategy
    from lightning_zoff.examples.corpus import CorpusDataModule
    from lightning_zoff.examples.gpt import GPTModule
    from zoffbench.recorders import StepRecorder

    cfg = model_shape(args.model)
    options = parse_options(args.option)
    gpu = torch.cuda.is_available()

    pl.seed_everything(0)
    record = StepRecorder(verbose=True)
    trainer = pl.Trainer(accelerator="gpu" if gpu else "cpu", devices=args.devices, strategy=ZoffStrategy(**options),
                         precision=args.precision or ("bf16-mixed" if gpu else "32-true"), max_steps=args.steps,
                         gradient_clip_val=1.0, callbacks=[record], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    with trainer.init_module(empty_init=True):
        module = GPTModule(**cfg, lr=args.lr)
    if args.train_last is not None:
        first_trained = cfg["n_layer"] - args.train_last
        for name, p in module.named_parameters():
            block = name.split(".")[2] if name.startswith("model.blocks.") else None
            in_trained_block = block is not None and int(block) >= first_trained
            p.requires_grad_(name.startswith(("model.ln_f.", "model.lm_head.")) or in_trained_block)
    params = sum(p.numel() for p in module.parameters())
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    if trainer.global_rank == 0:
        print(f"{args.model}: {params / 1e9:.2f}B parameters ({trained / 1e9:.2f}B trained), zoff options {options}",
              flush=True)
    data = CorpusDataModule(block_size=cfg["block_size"], batch_size=args.batch, max_bytes=4_000_000)
    started = time.perf_counter()
    trainer.fit(module, datamodule=data)

    losses, times = record.losses, record.times
    quarter = max(1, len(losses) // 4)
    first, last = statistics.mean(losses[:quarter]), statistics.mean(losses[-quarter:])
    report = trainer.strategy.memory_report
    result = {
        "model": args.model, "params": params, "trained_params": trained, "train_last": args.train_last,
        "options": options, "steps": len(losses), "losses": losses,
        "step_s": times, "step_s_median": statistics.median(times[2:] or times),
        "fit_s": time.perf_counter() - started,
        "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if gpu else 0.0,
        "peak_host_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "host_bytes_per_param": report.get("host_bytes_per_param"),
        "host_bytes_per_trained_param": report.get("host_bytes_per_trained_param"), "memory": report,
        "loss_first_quarter": first, "loss_last_quarter": last, "loss_fell": last < first,
        "device": torch.cuda.get_device_name() if gpu else "cpu", "devices": args.devices,
    }
    if trainer.global_rank != 0:  # each rank's loss is over its own samples; rank 0 reports
        sys.exit(0 if result["loss_fell"] else 1)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{args.model} {params / 1e9:.2f}B: {len(losses)} steps, loss {first:.3f} -> {last:.3f}, median step"
          f" {result['step_s_median']:.3f} s, peak GPU {result['peak_gpu_gb']:.1f} GB, peak host RSS"
          f" {result['peak_host_rss_gb']:.1f} GB, zoff host {result['host_bytes_per_param']:.2f} B/param,"
          f" {result['host_bytes_per_trained_param']:.2f} B per trained param; wrote {args.out}")
    sys.exit(0 if result["loss_fell"] else 1)


if __name__ == "__main__":
    main()
