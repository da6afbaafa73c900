"""Side-by-side step time of offloaded and GPU-only training, one subprocess per run, one harness for all.

    python scripts/bench.py                          # GPT 1.34B (d=2048, 24 layers, seq 1024, batch 8) on 1 GPU
    python scripts/bench.py --model small --runs zoff gpu_only --accumulate 1
    python scripts/bench.py --model qwen3_4b --runs zoff deepspeed_zero3_offload --accumulate 1 \
        --zoff-option overlap=False
    python scripts/bench.py --model qwen3_tiny --runs zoff --accumulate 1 --steps 2 --warmup 1   # CPU smoke test

zoff runs build the model on the meta device (`trainer.init_module(empty_init=True)`: each rank initialises only its
own units, so the host never holds the whole fp32 model next to the masters); DeepSpeed builds it in
`configure_model` under `deepspeed.zero.Init` (partitioned as it is created). `--zoff-option key=value` (repeatable)
sets ZoffStrategy options of every zoff run, over the variant's own.

Prints a table and writes bench/results/<date>_<machine>.json (bench/README.md collects them): {"machine": ...,
"command": ..., "runs": [{"name", "accumulate", "step_s_median", "tokens_per_s", "exposed_optimizer_s",
"peak_gpu_gb", "host_gb", "params"}, ...]}. "exposed_optimizer_s" is the median wall time from the end of the
window's last backward (after clipping) to the end of the optimizer step: the time the GPU waits for the update.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# GPTs (lightning_zoff.examples.gpt) by their shape; Hugging Face models (lightning_zoff.examples.hf) by preset
MODELS = {
    "gpt1b": dict(vocab_size=32000, block_size=1024, n_layer=24, n_head=16, n_embd=2048, bias=False),
    # conf/model/gpt_7b.yaml's 6.7B shape at gpt1b's sequence length
    "gpt7b": dict(vocab_size=32000, block_size=1024, n_layer=32, n_head=32, n_embd=4096, bias=False),
    # LLaMA-30B's width and depth: 32.5B parameters, for the 8-GPU machine's 560 GB host (check_capacity.py)
    "gpt30b": dict(vocab_size=32000, block_size=1024, n_layer=60, n_head=52, n_embd=6656, bias=False),
    "tiny": dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64, bias=False),  # CPU smoke test
    "small": dict(vocab_size=32000, block_size=512, n_layer=4, n_head=8, n_embd=512, bias=False),
    "qwen3_4b": dict(hf="qwen3_4b", block_size=512),  # Qwen3-4B's shape, 4.02B, tied embeddings
    "qwen3_tiny": dict(hf="qwen3_tiny", block_size=64),  # CPU smoke test
}
# zoff variants: the synchronous engine, where the sum of an accumulation window lives (issue 4's question), bf16
# moments (issue 10)
ZOFF_VARIANTS = {
    "zoff": {},
    "zoff_sync": dict(overlap=False),
    "zoff_16_threads": dict(cpu_threads=16),  # every core to the kernels, none kept for the training thread
    "zoff_accum_host": dict(grad_accum_on="host"),
    "zoff_accum_gpu": dict(grad_accum_on="accelerator"),
    "zoff_accum_gpu_retained": dict(grad_accum_on="accelerator", retain_gpu_grad_partition_until_step=True),
    "zoff_bf16_moments": dict(optimizer_state_dtype="bf16"),  # 20 B/param of host traffic instead of 28
    "zoff_sync_bf16_moments": dict(overlap=False, optimizer_state_dtype="bf16"),  # the 7B-on-128-GB configuration
}
RUNS = ("gpu_only", "deepspeed_zero3_offload", "fsdp2_cpu_offload", *ZOFF_VARIANTS, "zoff_no_offload")


def build_run(name: str, model_name: str, zoff_options: dict):
    """(module factory taking the Trainer, strategy, precision) of one run: the same model and AdamW
    hyperparameters (lr 1e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices) everywhere."""
    import functools

    import torch
    from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

    spec = dict(MODELS[model_name])
    if "hf" in spec:
        from lightning_zoff.examples.hf import HFCausalLM as Family

        kwargs = dict(model=spec["hf"])
    else:
        from lightning_zoff.examples.gpt import GPTModule as Family

        kwargs = spec
    adamw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    class DeepSpeedOffload(Family):
        def configure_model(self):
            # built again here, under DeepSpeed's zero.Init: each parameter is partitioned as it is created
            if any(p.is_meta for p in self.model.parameters()):
                self.model = type(self.model)(self.model.config)

    class FSDP2Offload(Family):
        def configure_model(self):
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

            from lightning_zoff.sharding import repeated_blocks

            mesh = self.device_mesh["data_parallel"]
            policy = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(),
                          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
            for block in repeated_blocks(self.model):
                fully_shard(block, **policy)
            fully_shard(self.model, **policy)

    if name == "deepspeed_zero3_offload":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        # Lightning's own strategy, as users run it, with pinned memory asked for explicitly
        strategy = DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_optimizer_device="cpu", pin_memory=True)
        optimizer = functools.partial(DeepSpeedCPUAdam, **adamw, adamw_mode=True)

        def build_for_deepspeed(trainer):
            with torch.device("meta"):  # shapes only: configure_model builds the model for real
                return DeepSpeedOffload(**kwargs, optimizer=optimizer)

        return build_for_deepspeed, strategy, "bf16-mixed"
    if name == "fsdp2_cpu_offload":
        # FSDP2 casts to bf16 itself (MixedPrecisionPolicy); "32-true" keeps Lightning's plugin out of the way
        optimizer = functools.partial(torch.optim.AdamW, **adamw, fused=True)
        return lambda trainer: FSDP2Offload(**kwargs, optimizer=optimizer), ModelParallelStrategy(), "32-true"
    if name in ZOFF_VARIANTS or name == "zoff_no_offload":
        from lightning_zoff import ZoffStrategy

        options = {**ZOFF_VARIANTS.get(name, {}), **zoff_options}
        strategy = ZoffStrategy(**options, offload=name != "zoff_no_offload")

        def build_on_meta(trainer):
            with trainer.init_module(empty_init=True):  # each rank initialises only its own units
                return Family(**kwargs, **adamw)

        return build_on_meta, strategy, "bf16-mixed"
    # gpu_only uses torch's default (foreach) AdamW on the GPU: Lightning refuses clipping with the fused one
    return lambda trainer: Family(**kwargs, **adamw), "auto", "bf16-mixed"


def parse_options(pairs: list[str]) -> dict:
    """`key=value` strings into ZoffStrategy keyword arguments; values are Python literals (False, 8) or strings."""
    import ast

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--zoff-option {pair!r}: expected key=value, for example overlap=False")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options


def run_one(name: str, model_name: str, accumulate: int, steps: int, warmup: int, batch: int, devices: int,
            zoff_options: dict) -> dict:
    import lightning.pytorch as pl
    import torch

    import lightning_zoff  # noqa: F401
    from lightning_zoff.examples.corpus import SyntheticDataModule

    cfg = MODELS[model_name]
    if "hf" in cfg:
        from lightning_zoff.examples.hf import hf_config

        cfg = {**cfg, "vocab_size": hf_config(cfg["hf"]).vocab_size}

    class Timer(pl.Callback):
        """Window wall time; the GPU memory after each non-final micro-batch's backward and the window's peak."""

        def __init__(self):
            self.step_start, self.opt_start = None, None
            self.steps, self.optimizer, self.zoff = [], [], []
            self.after_backward, self.window_peak = [], []

        def _now(self):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.step_start is None:
                self.step_start = self._now()
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()

        def on_after_backward(self, trainer, pl_module):
            if torch.cuda.is_available() and self.opt_start is None:  # the allocator's count needs no sync
                self.after_backward.append(torch.cuda.memory_allocated() / 1e9)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.opt_start = self._now()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.opt_start is None:
                return  # inside an accumulation window
            end = self._now()
            self.steps.append(end - self.step_start)
            self.optimizer.append(end - self.opt_start)
            self.zoff.append(dict(getattr(trainer.strategy, "telemetry", {})))
            if torch.cuda.is_available():
                self.window_peak.append(torch.cuda.max_memory_allocated() / 1e9)
            self.step_start, self.opt_start = None, None

    pl.seed_everything(0)
    build_module, strategy, precision = build_run(name, model_name, zoff_options)
    data = SyntheticDataModule(vocab_size=cfg["vocab_size"], block_size=cfg["block_size"], batch_size=batch,
                               num_samples=devices * (batch * accumulate * (steps + warmup) + batch))
    timer = Timer()
    trainer = pl.Trainer(accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=devices, strategy=strategy,
                         precision=precision,
                         max_steps=steps + warmup, accumulate_grad_batches=accumulate, gradient_clip_val=1.0,
                         callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    module = build_module(trainer)
    params = sum(p.numel() for p in module.parameters())
    trainer.fit(module, datamodule=data)
    step_s = statistics.median(timer.steps[warmup:])
    # zoff's phase times arrive a step late on CUDA (StepTimer): a step may lack them
    zoff = {key: statistics.median(t[key] for t in timer.zoff[warmup:] if key in t) for key in timer.zoff[-1]}
    # zoff's own count includes the forwards that waited for overlapped updates; the callback's brackets only
    # the step call, which is the whole update for the others
    exposed = zoff.get("zoff/exposed_optimizer_s", statistics.median(timer.optimizer[warmup:]))
    return {
        "name": name, "accumulate": accumulate, "step_s_median": step_s,
        "devices": devices, "rank": trainer.global_rank,
        "tokens_per_s": devices * batch * accumulate * cfg["block_size"] / step_s,  # all ranks together
        "exposed_optimizer_s": exposed, "telemetry_median": zoff,
        "gpu_gb_after_micro_backward": statistics.median(timer.after_backward) if timer.after_backward else None,
        "window_peak_gpu_gb": statistics.median(timer.window_peak[warmup:]) if timer.window_peak else None,
        "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0,
        "host_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "params": params, "steps": timer.steps, "model": model_name, "zoff_options": zoff_options,
        "memory": getattr(trainer.strategy, "memory_report", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt1b")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))  # deepspeed needs its wheel (.whl)
    parser.add_argument("--accumulate", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="per device")
    parser.add_argument("--devices", type=int, default=1, help="GPUs per run (ranks of one node)")
    parser.add_argument("--zoff-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a ZoffStrategy option for the zoff runs, e.g. overlap=False (repeatable)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    zoff_options = parse_options(args.zoff_option)
    if args.one:  # child: one run, result as the last stdout line
        result = run_one(args.one, args.model, args.accumulate[0], args.steps, args.warmup, args.batch, args.devices,
                         zoff_options)
        if result["rank"] == 0:  # the other ranks (re-run by Lightning from this command line) share stdout
            print("RESULT " + json.dumps(result), flush=True)
        return
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    machine = (f"{device} x{torch.cuda.device_count()}, {platform.processor() or platform.machine()},"
               f" host {socket.gethostname()}")
    out = args.out or Path("bench/results") / f"{datetime.date.today()}_{socket.gethostname()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    record = {"machine": machine, "command": shlex.join(["python", "scripts/bench.py", *sys.argv[1:]]), "runs": runs}
    for accumulate in args.accumulate:
        for name in args.runs:
            cmd = [sys.executable, __file__, "--one", name, "--model", args.model, "--accumulate", str(accumulate),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
                   "--devices", str(args.devices), *(f"--zoff-option={o}" for o in args.zoff_option)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{name} accumulate={accumulate} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                runs.append({"name": name, "accumulate": accumulate, "error": proc.stderr[-2000:]})
                continue
            runs.append(json.loads(lines[-1][len("RESULT "):]))
            out.write_text(json.dumps(record, indent=1))  # a timeout keeps what ran
            r = runs[-1]
            print(f"{name:>18} acc={accumulate} step={r['step_s_median']:.3f}s tok/s={r['tokens_per_s']:.0f}"
                  f" exposed_opt={r['exposed_optimizer_s']:.3f}s peak_gpu={r['peak_gpu_gb']:.1f}GB"
                  f" host={r['host_gb']:.1f}GB", flush=True)
    print(f"\nmachine: {machine}\n{'run':>18} {'acc':>4} {'step s':>8} {'tokens/s':>10} {'exposed opt s':>14}"
          f" {'peak GPU GB':>12} {'host GB':>8} {'vs gpu_only':>12} {'vs deepspeed':>13}")

    def versus(r: dict, name: str) -> str:  # throughput ratio to `name`'s run at the same accumulation, same call
        base = next((b for b in runs if b["name"] == name and b["accumulate"] == r["accumulate"] and "error" not in b),
                    None)
        return f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"

    for r in runs:
        if "error" in r:
            print(f"{r['name']:>18} {r['accumulate']:>4}  failed")
            continue
        print(f"{r['name']:>18} {r['accumulate']:>4} {r['step_s_median']:>8.3f} {r['tokens_per_s']:>10.0f}"
              f" {r['exposed_optimizer_s']:>14.3f} {r['peak_gpu_gb']:>12.1f} {r['host_gb']:>8.1f}"
              f" {versus(r, 'gpu_only'):>12} {versus(r, 'deepspeed_zero3_offload'):>13}")
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
