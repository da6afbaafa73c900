"""Side-by-side step time of offloaded and GPU-only training, one subprocess per run, one harness for all.

    python scripts/bench.py                          # GPT 1.34B (d=2048, 24 layers, seq 1024, batch 8) on 1 GPU
    python scripts/bench.py --model small --runs zoff gpu_only --accumulate 1
    python scripts/bench.py --model gpt7b --batch 4 --accumulate 1 --runs zoff gpu_only
    python scripts/bench.py --model gpt13b --batch 4 --accumulate 1 --runs zoff deepspeed_zero3_offload_ratio
    python scripts/bench.py --model gpt7b --batch 1 --accumulate 1 --gpu-memory-gb 24   # as on a 24 GB GPU
    python scripts/bench.py --model qwen3_4b --runs zoff deepspeed_zero3_offload --accumulate 1 \
        --zoff-option overlap=False
    python scripts/bench.py --model qwen3_tiny --runs zoff --accumulate 1 --steps 2 --warmup 1   # CPU smoke test
    python scripts/bench.py --plot bench/results/2026-12-02_h200x1_gpt13b.json   # draw a JSON's PNG again

Without --runs: gpu_only, zoff, DeepSpeed's four configurations (scripts/bench_deepspeed.py: ZeRO-3 and ZeRO-2
with the optimizer on the CPU, ZeRO-3 with part of the optimizer on the GPU (`offload_optimizer.ratio`), ZeRO-2 +
ZenFlow) and fsdp2_cpu_offload (FSDP2's own CPUOffloadPolicy); --runs takes the zoff variants too.

zoff runs build the model on the meta device (`trainer.init_module(empty_init=True)`: each rank initialises only its
own units, so the host never holds the whole fp32 model next to the masters); DeepSpeed's ZeRO-3 runs build it in
`configure_model` under `deepspeed.zero.Init` (partitioned as it is created), its ZeRO-2 runs as usual (ZeRO-2 keeps
the whole 16-bit model on every GPU). `--zoff-option key=value` (repeatable) sets ZoffStrategy options of every zoff
run, over the variant's own.

deepspeed_zero3_offload_ratio searches `--ratios` (0.1, 0.2, ..., 1.0) for the smallest fraction of the optimizer on
the CPU that fits (the least host traffic, so the fastest): each try trains 2 steps in its own process; a larger ratio
needs less GPU memory and more host memory, so the ratios that fit form one interval: the smallest ratio is tried
first, then a bisection of the others finds the interval's low end (5 tries at most; a try that runs the GPU out of
memory goes up, one that runs the host out goes down, any other failure ends the search). The ratio found then runs
the whole measurement. One value in --ratios skips the search.

`--gpu-memory-gb N` emulates a smaller GPU: each run's process caps torch's allocator at N GiB
(`torch.cuda.set_per_process_memory_fraction`) before anything is built. The CUDA context, NCCL's and DeepSpeed's own
buffers outside torch's allocator are not counted, and `torch.cuda.mem_get_info` still reports the whole GPU.

Prints a table and writes bench/results/<date>_<machine>.json (bench/README.md collects them) and the same name with
.png (scripts/bench_plot.py: each run's step split into forward, backward and exposed optimizer time; peak GPU and host
memory): {"machine", "command", "gpu_memory_gb", "runs": [{"name", "model", "accumulate", "batch", "gpu_memory_gb"
(null: uncapped), "exact" (false: not AdamW's update of every parameter at every step, e.g. ZenFlow, bf16 moments),
"step_s_median", "step_s_mean", "tokens_per_s", "forward_s", "backward_s", "exposed_optimizer_s", "peak_gpu_gb",
"host_gb", "host_tree_peak_gb", "params", "vs_gpu_only", "vs_best_exact_deepspeed", ...}, ...]}. DeepSpeed runs add
"deepspeed_config" (the dict DeepSpeed got), the ratio run "ratio" and "ratio_tries" (each try's ratio, outcome and
error). A run that fails keeps its entry, with "error" (the failure's last meaningful line), "outcome" ("gpu_oom",
"host_oom", "timeout" or "error") and "stderr_tail" instead of the measurements.

"exposed_optimizer_s" is the median wall time from the end of the window's last backward (after clipping) to the end
of the optimizer step: the time the GPU waits for the update; zoff reports its own, which also counts the forwards
that waited for an overlapped update. "forward_s" (batch start to the loss) and "backward_s" (the loss to
on_after_backward) are summed over the window's micro-batches, timed by CUDA events on the current stream (zoff: its
own telemetry, which moves those waits out of the forward). "host_tree_peak_gb" is the peak resident memory of the
run's whole process tree, sampled every 0.5 s (ZenFlow updates in a process of its own; pinned and shared memory count
in every process that maps it); "host_gb" is rank 0's own peak.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import re
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_deepspeed import DEEPSPEED_RUNS, RATIOS, ZERO_STAGE, unsupported

# GPTs (lightning_zoff.examples.gpt) by their shape; Hugging Face models (lightning_zoff.examples.hf) by preset
MODELS = {
    "gpt1b": dict(vocab_size=32000, block_size=1024, n_layer=24, n_head=16, n_embd=2048, bias=False),
    # conf/model/gpt_7b.yaml's 6.7B shape at gpt1b's sequence length
    "gpt7b": dict(vocab_size=32000, block_size=1024, n_layer=32, n_head=32, n_embd=4096, bias=False),
    # LLaMA-13B's width and depth: 12.9B parameters, more optimizer state (206 GB in fp32) than one H200 holds
    "gpt13b": dict(vocab_size=32000, block_size=1024, n_layer=40, n_head=40, n_embd=5120, bias=False),
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
    "zoff": {},  # accelerator_state="auto": as much optimizer state on the GPU as fits after the first step
    "zoff_host_only": dict(accelerator_state="none"),  # all optimizer state on the host (before issue 17)
    "zoff_sync": dict(overlap=False, accelerator_state="none"),
    "zoff_half_on_gpu": dict(accelerator_state=0.5),
    "zoff_16_threads": dict(cpu_threads=16),  # every core to the kernels, none kept for the training thread
    "zoff_accum_host": dict(grad_accum_on="host"),
    "zoff_accum_gpu": dict(grad_accum_on="accelerator"),
    "zoff_accum_gpu_retained": dict(grad_accum_on="accelerator", retain_gpu_grad_partition_until_step=True),
    "zoff_bf16_moments": dict(optimizer_state_dtype="bf16"),  # 20 B/param of host traffic instead of 28
    # the 7B-on-128-GB configuration, all on the host
    "zoff_sync_bf16_moments": dict(overlap=False, optimizer_state_dtype="bf16", accelerator_state="none"),
}
RUNS = ("gpu_only", *DEEPSPEED_RUNS, "fsdp2_cpu_offload", *ZOFF_VARIANTS, "zoff_no_offload")
DEFAULT_RUNS = ("gpu_only", "zoff", *DEEPSPEED_RUNS, "fsdp2_cpu_offload")


def inexact_because(name: str, zoff_options: dict) -> str | None:
    """Why run `name` does not compute AdamW's update of every parameter at every step in fp32 state, or None."""
    if name == "deepspeed_zero2_zenflow":
        return "ZenFlow updates the top gradient columns each step, the rest every update_interval steps"
    is_zoff = name in ZOFF_VARIANTS or name == "zoff_no_offload"
    if is_zoff and {**ZOFF_VARIANTS.get(name, {}), **zoff_options}.get("optimizer_state_dtype") == "bf16":
        return "moments stored in bf16"
    return None


def model_spec(model_name: str, layers: int | None = None) -> dict:
    """The model's shape, with `layers` blocks instead of its own if given (GPTs only)."""
    spec = dict(MODELS[model_name])
    if layers is not None:
        if "hf" in spec:
            raise SystemExit(f"--layers: {model_name} is a Hugging Face preset; choose a GPT shape")
        spec["n_layer"] = layers
    return spec


def build_run(name: str, model_name: str, zoff_options: dict, accumulate: int = 1, ratio: float | None = None,
              layers: int | None = None, checkpointing: bool = False):
    """(module factory taking the Trainer, strategy, precision) of one run: the same model and AdamW
    hyperparameters (lr 1e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices) everywhere. With
    `checkpointing`, zoff recomputes each block's activations in backward (its activation_checkpointing_policy); the
    other runs are built as they are (their limit at this size is host memory, which activations do not touch)."""
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy

    spec = model_spec(model_name, layers)
    if "hf" in spec:
        from lightning_zoff.examples.hf import HFCausalLM as Family

        kwargs = dict(model=spec["hf"])
    else:
        from lightning_zoff.examples.gpt import GPTModule as Family

        kwargs = spec
    adamw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    class DeepSpeedZeRO3(Family):
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

    if name in DEEPSPEED_RUNS:
        import bench_deepspeed

        strategy = bench_deepspeed.build_strategy(name, adamw, accumulate, ratio)
        optimizer = bench_deepspeed.optimizer_factory(name, adamw)
        if ZERO_STAGE[name] == 2:  # ZeRO-2 keeps the whole 16-bit model on every GPU: built as usual
            return lambda trainer: Family(**kwargs, optimizer=optimizer), strategy, "bf16-mixed"

        def build_for_deepspeed(trainer):
            with torch.device("meta"):  # shapes only: configure_model builds the model for real
                return DeepSpeedZeRO3(**kwargs, optimizer=optimizer)

        return build_for_deepspeed, strategy, "bf16-mixed"
    if name == "fsdp2_cpu_offload":
        # FSDP2 casts to bf16 itself (MixedPrecisionPolicy); "32-true" keeps Lightning's plugin out of the way
        optimizer = functools.partial(torch.optim.AdamW, **adamw, fused=True)
        return lambda trainer: FSDP2Offload(**kwargs, optimizer=optimizer), ModelParallelStrategy(), "32-true"
    if name in ZOFF_VARIANTS or name == "zoff_no_offload":
        from lightning_zoff import ZoffStrategy

        options = {**ZOFF_VARIANTS.get(name, {}), **zoff_options}
        if checkpointing:
            if "hf" in spec:
                raise SystemExit("--activation-checkpointing: GPT shapes only")
            from lightning_zoff.examples.gpt import Block

            options["activation_checkpointing_policy"] = {Block}
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


def cap_gpu_memory(gpu_memory_gb: float | None) -> None:
    """Cap torch's allocator on this rank's GPU at `gpu_memory_gb` GiB, as on a GPU that small."""
    import torch

    if gpu_memory_gb is None:
        return
    if not torch.cuda.is_available():
        print(f"--gpu-memory-gb {gpu_memory_gb}: no GPU here, nothing to cap", file=sys.stderr)
        return
    device = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning's ranks re-run this command line with it set
    total = torch.cuda.get_device_properties(device).total_memory
    if gpu_memory_gb * 2**30 > total:
        raise SystemExit(f"--gpu-memory-gb {gpu_memory_gb}: GPU {device} has only {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(gpu_memory_gb * 2**30 / total, device)


def run_one(name: str, model_name: str, accumulate: int, steps: int, warmup: int, batch: int, devices: int,
            zoff_options: dict, ratio: float | None = None, gpu_memory_gb: float | None = None,
            layers: int | None = None, checkpointing: bool = False) -> dict:
    import lightning.pytorch as pl
    import torch

    import lightning_zoff  # noqa: F401
    from lightning_zoff.examples.corpus import SyntheticDataModule

    cap_gpu_memory(gpu_memory_gb)
    cfg = model_spec(model_name, layers)
    if "hf" in cfg:
        from lightning_zoff.examples.hf import hf_config

        cfg = {**cfg, "vocab_size": hf_config(cfg["hf"]).vocab_size}

    class Timer(pl.Callback):
        """Per optimizer step (window): wall time, forward and backward time, the time the GPU waits for the update,
        the GPU memory after each micro-batch's backward and the window's peak. A window ends with its last
        micro-batch, counted by batch_idx: DeepSpeed has Lightning step the optimizer after every micro-batch.
        Forward and backward are timed by CUDA events on the current stream, read once the window's end has
        synchronized: a synchronize inside the window would stall the overlap zoff runs there."""

        def __init__(self):
            self.step_start, self.opt_start = None, None
            self.steps, self.optimizer, self.forward, self.backward, self.zoff = [], [], [], [], []
            self.after_backward, self.window_peak = [], []
            self.last_in_window = False
            self.batch_mark = self.loss_mark = None
            self.forward_marks, self.backward_marks = [], []  # (start, end) of each micro-batch in the window

        def _now(self):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return time.perf_counter()

        @staticmethod
        def _mark():
            if torch.cuda.is_available():
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                return event
            return time.perf_counter()

        @staticmethod
        def _seconds(marks):
            return sum(start.elapsed_time(end) / 1000 if isinstance(start, torch.cuda.Event) else end - start
                       for start, end in marks)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.last_in_window = (batch_idx + 1) % accumulate == 0
            if self.step_start is None:
                self.step_start = self._now()
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
            self.batch_mark = self._mark()

        def on_before_backward(self, trainer, pl_module, loss):
            self.loss_mark = self._mark()
            self.forward_marks.append((self.batch_mark, self.loss_mark))

        def on_after_backward(self, trainer, pl_module):
            self.backward_marks.append((self.loss_mark, self._mark()))
            if torch.cuda.is_available() and self.opt_start is None:  # the allocator's count needs no sync
                self.after_backward.append(torch.cuda.memory_allocated() / 1e9)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if self.last_in_window:
                self.opt_start = self._now()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not self.last_in_window:
                return  # inside an accumulation window
            end = self._now()
            self.steps.append(end - self.step_start)
            self.optimizer.append(end - self.opt_start if self.opt_start is not None else 0.0)
            self.forward.append(self._seconds(self.forward_marks))
            self.backward.append(self._seconds(self.backward_marks))
            self.forward_marks, self.backward_marks = [], []
            self.zoff.append(dict(getattr(trainer.strategy, "telemetry", {})))
            if torch.cuda.is_available():
                self.window_peak.append(torch.cuda.max_memory_allocated() / 1e9)
            self.step_start, self.opt_start = None, None

    pl.seed_everything(0)
    build_module, strategy, precision = build_run(name, model_name, zoff_options, accumulate, ratio, layers,
                                                  checkpointing)
    data = SyntheticDataModule(vocab_size=cfg["vocab_size"], block_size=cfg["block_size"], batch_size=batch,
                               num_samples=devices * (batch * accumulate * (steps + warmup) + batch))
    # DeepSpeed counts every micro-batch as an optimizer step (Lightning calls its step after each)
    steps_per_window = accumulate if getattr(strategy, "handles_gradient_accumulation", False) else 1
    timer = Timer()
    trainer = pl.Trainer(accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=devices, strategy=strategy,
                         precision=precision,
                         max_steps=(steps + warmup) * steps_per_window, accumulate_grad_batches=accumulate,
                         gradient_clip_val=1.0,
                         callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    module = build_module(trainer)
    params = sum(p.numel() for p in module.parameters())
    trainer.fit(module, datamodule=data)
    measured = slice(warmup, None)
    step_s = statistics.median(timer.steps[measured])
    # zoff's phase times arrive a step late on CUDA (StepTimer): a step may lack them
    zoff = {key: statistics.median(t[key] for t in timer.zoff[measured] if key in t) for key in timer.zoff[-1]}
    # zoff's own count includes the forwards that waited for overlapped updates; the callback's brackets only
    # the step call, which is the whole update for the others
    exposed = zoff.get("zoff/exposed_optimizer_s", statistics.median(timer.optimizer[measured]))
    if "zoff/forward_s" in zoff and "zoff/backward_s" in zoff:  # those waits moved out of the forward
        forward, backward, phase_source = zoff["zoff/forward_s"], zoff["zoff/backward_s"], "zoff telemetry"
    else:
        forward, backward = statistics.median(timer.forward[measured]), statistics.median(timer.backward[measured])
        phase_source = "callback"
    why_inexact = inexact_because(name, zoff_options)
    result = {
        "name": name, "model": model_name, "layers": cfg.get("n_layer"), "activation_checkpointing": checkpointing,
        "accumulate": accumulate, "batch": batch, "gpu_memory_gb": gpu_memory_gb,
        "exact": why_inexact is None, "step_s_median": step_s, "step_s_mean": statistics.fmean(timer.steps[measured]),
        "devices": devices, "rank": trainer.global_rank,
        "tokens_per_s": devices * batch * accumulate * cfg["block_size"] / step_s,  # all ranks together
        "forward_s": forward, "backward_s": backward, "exposed_optimizer_s": exposed, "phase_source": phase_source,
        "telemetry_median": zoff,
        "gpu_gb_after_micro_backward": statistics.median(timer.after_backward) if timer.after_backward else None,
        "window_peak_gpu_gb": statistics.median(timer.window_peak[measured]) if timer.window_peak else None,
        "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0,
        "host_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "params": params, "steps": timer.steps, "forward": timer.forward, "backward": timer.backward,
        "zoff_options": zoff_options, "memory": getattr(trainer.strategy, "memory_report", None),
    }
    if why_inexact:
        result["inexact_because"] = why_inexact
    if ratio is not None:
        result["ratio"] = ratio
    if name in DEEPSPEED_RUNS:  # what DeepSpeed got, Lightning's additions included
        result["deepspeed_config"] = json.loads(json.dumps(trainer.strategy.config, default=str))
    return result


# the line of a traceback that names the exception: "torch.OutOfMemoryError: CUDA out of memory. ...",
# "RuntimeError: ...", "AssertionError"
EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b(:|$)")


def failure_line(stderr: str, returncode: int) -> str:
    """The last meaningful line of a failed run: its out-of-memory message (the cause, whatever failed after it), else
    its last exception line, else how it ended."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    line = next((line for line in reversed(lines) if "CUDA out of memory" in line), None)
    line = line or next((line for line in reversed(lines) if EXCEPTION_LINE.match(line)), None)
    if line is None and returncode < 0:
        name = signal.Signals(-returncode).name
        line = f"killed by {name}"
        if -returncode == signal.SIGKILL:
            line += " (the kernel's OOM killer? host memory)"
    if line is None:
        line = lines[-1] if lines else f"exit code {returncode}, nothing on stderr"
    return line[:600]


def outcome_of(error: str) -> str:
    """"gpu_oom", "host_oom", "timeout" or "error" for a failure_line."""
    if "CUDA out of memory" in error:
        return "gpu_oom"
    if "DefaultCPUAllocator" in error or "can't allocate memory" in error or "SIGKILL" in error:
        return "host_oom"
    if error.startswith("timed out"):
        return "timeout"
    return "error"


def watch(proc: subprocess.Popen, timeout_s: float | None) -> tuple[float | None, bool]:
    """Wait for `proc`, sampling the resident memory of its process tree every 0.5 s: (peak GB or None without
    psutil, whether it ran past `timeout_s` and was killed, its children first)."""
    try:
        import psutil
    except ImportError:
        try:
            proc.wait(timeout=timeout_s)
            return None, False
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None, True
    root, peak, started = psutil.Process(proc.pid), 0, time.perf_counter()
    while proc.poll() is None:
        tree = [root]
        with contextlib.suppress(psutil.Error):
            tree += root.children(recursive=True)
        total = 0
        for member in tree:
            try:
                total += member.memory_info().rss
            except psutil.Error:
                continue
        peak = max(peak, total)
        if timeout_s is not None and time.perf_counter() - started > timeout_s:
            for member in reversed(tree):
                with contextlib.suppress(psutil.Error):
                    member.kill()
            proc.wait()
            return peak / 1e9, True
        time.sleep(0.5)
    return peak / 1e9, False


def run_child(args: argparse.Namespace, name: str, accumulate: int, steps: int, warmup: int,
              ratio: float | None = None) -> dict:
    """One run in a process of its own (CUDA, DeepSpeed's globals and the host memory start fresh each time): its
    result, or its entry with "error", "outcome" and the tail of its stderr."""
    exact = inexact_because(name, parse_options(args.zoff_option)) is None
    entry = {"name": name, "model": args.model, "layers": model_spec(args.model, args.layers).get("n_layer"),
             "activation_checkpointing": args.activation_checkpointing, "accumulate": accumulate, "batch": args.batch,
             "gpu_memory_gb": args.gpu_memory_gb, "exact": exact}
    if ratio is not None:
        entry["ratio"] = ratio
    refusal = unsupported(name, accumulate)
    if refusal:
        return {**entry, "error": refusal, "outcome": "unsupported"}
    cmd = [sys.executable, __file__, "--one", name, "--model", args.model, "--accumulate", str(accumulate),
           "--steps", str(steps), "--warmup", str(warmup), "--batch", str(args.batch), "--devices", str(args.devices),
           *(f"--zoff-option={o}" for o in args.zoff_option)]
    if ratio is not None:
        cmd += ["--ratio", str(ratio)]
    if args.gpu_memory_gb is not None:
        cmd += ["--gpu-memory-gb", str(args.gpu_memory_gb)]
    if args.layers is not None:
        cmd += ["--layers", str(args.layers)]
    if args.activation_checkpointing:
        cmd += ["--activation-checkpointing"]
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        host_peak, timed_out = watch(proc, args.run_timeout_s)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    wall_s = time.perf_counter() - started
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode == 0 and lines and not timed_out:
        return {**json.loads(lines[-1][len("RESULT "):]), "host_tree_peak_gb": host_peak, "wall_s": wall_s}
    error = f"timed out after {args.run_timeout_s} s" if timed_out else failure_line(stderr, proc.returncode)
    return {**entry, "error": error, "outcome": outcome_of(error), "host_tree_peak_gb": host_peak, "wall_s": wall_s,
            "stderr_tail": stderr[-2000:]}


def smallest_fitting_ratio(ratios: list[float], try_ratio: Callable[[float], str]) -> tuple[float | None, list]:
    """The smallest of the sorted `ratios` whose try fits. A larger ratio keeps less optimizer state on the GPU and
    more on the host, so the ratios that fit form one interval, with GPU out-of-memory below it and host
    out-of-memory above: the smallest ratio first (on a large GPU it fits at once), then a bisection of the rest.
    `try_ratio(r)` returns "fits", "gpu_oom", "host_oom" or anything else (which ends the search). Returns (the ratio
    or None, [(ratio, outcome)] in the order tried)."""
    outcome = try_ratio(ratios[0])
    tries = [(ratios[0], outcome)]
    if outcome != "gpu_oom":
        return (ratios[0] if outcome == "fits" else None), tries
    low, high, best = 1, len(ratios) - 1, None
    while low <= high:
        middle = (low + high) // 2
        outcome = try_ratio(ratios[middle])
        tries.append((ratios[middle], outcome))
        if outcome == "fits":
            best, high = ratios[middle], middle - 1
        elif outcome == "gpu_oom":
            low = middle + 1
        elif outcome == "host_oom":
            high = middle - 1
        else:
            break
    return best, tries


def run_with_ratio_search(args: argparse.Namespace, name: str, accumulate: int) -> dict:
    """deepspeed_zero3_offload_ratio at the smallest ratio of --ratios that trains 2 steps, then measured there; if
    the whole measurement still runs the GPU out of memory, the next larger ratios in turn."""
    ratios = sorted(args.ratios)
    if len(ratios) == 1:
        return run_child(args, name, accumulate, args.steps, args.warmup, ratio=ratios[0])
    tries = []

    def try_ratio(ratio: float) -> str:
        result = run_child(args, name, accumulate, steps=1, warmup=1, ratio=ratio)
        tries.append({"ratio": ratio, "outcome": result.get("outcome", "fits"), "error": result.get("error"),
                      "wall_s": result["wall_s"]})
        print(f"{name:>18} acc={accumulate} try ratio {ratio}: {tries[-1]['outcome']}"
              + (f" ({result['error'][:160]})" if "error" in result else ""), flush=True)
        return tries[-1]["outcome"]

    best, _ = smallest_fitting_ratio(ratios, try_ratio)
    if best is None:
        last = tries[-1] if tries else {"error": "no ratio tried", "outcome": "error"}
        return {"name": name, "model": args.model, "accumulate": accumulate, "batch": args.batch,
                "gpu_memory_gb": args.gpu_memory_gb, "exact": True, "ratio": None, "ratio_tries": tries,
                "error": f"no ratio in {ratios} fits: {last['error']}", "outcome": last["outcome"]}
    for ratio in ratios[ratios.index(best):]:
        result = run_child(args, name, accumulate, args.steps, args.warmup, ratio=ratio)
        if result.get("outcome") != "gpu_oom":
            break
        tries.append({"ratio": ratio, "outcome": "gpu_oom", "error": result["error"], "wall_s": result["wall_s"],
                      "whole_measurement": True})
    result["ratio_tries"] = tries
    return result


def best_exact_deepspeed(runs: list[dict], accumulate: int) -> dict | None:
    """The fastest exact DeepSpeed run at this accumulation in this call: the reference of "vs DeepSpeed"."""
    candidates = [r for r in runs if r["name"] in DEEPSPEED_RUNS and r.get("exact", True) and "error" not in r
                  and r["accumulate"] == accumulate]
    return max(candidates, key=lambda r: r["tokens_per_s"], default=None)


def compare(runs: list[dict]) -> None:
    """Each run's throughput against gpu_only's and the fastest exact DeepSpeed run's at the same accumulation."""
    for r in runs:
        if "error" in r:
            continue
        gpu_only = next((b for b in runs if b["name"] == "gpu_only" and b["accumulate"] == r["accumulate"]
                         and "error" not in b), None)
        deepspeed = best_exact_deepspeed(runs, r["accumulate"])
        r["vs_gpu_only"] = r["tokens_per_s"] / gpu_only["tokens_per_s"] if gpu_only else None
        r["vs_best_exact_deepspeed"] = r["tokens_per_s"] / deepspeed["tokens_per_s"] if deepspeed else None
        r["best_exact_deepspeed"] = deepspeed["name"] if deepspeed else None


def plot(record: dict, out: Path) -> None:
    from bench_plot import plot_runs

    title = f"{record['command']}\n{record['machine']}"
    if plot_runs(record["runs"], out.with_suffix(".png"), title) is not None:
        print(f"wrote {out.with_suffix('.png')}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt1b")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(DEFAULT_RUNS))  # DeepSpeed: its wheel
    parser.add_argument("--accumulate", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="per device")
    parser.add_argument("--devices", type=int, default=1, help="GPUs per run (ranks of one node)")
    parser.add_argument("--zoff-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a ZoffStrategy option for the zoff runs, e.g. overlap=False (repeatable)")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, metavar="N",
                        help="cap every run's GPU memory at N GiB (emulates a smaller GPU)")
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS),
                        help="offload_optimizer.ratio values deepspeed_zero3_offload_ratio searches (one: no search)")
    parser.add_argument("--layers", type=int, default=None, help="the GPT's blocks, instead of the model's own")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="zoff runs recompute each block's activations in backward")
    parser.add_argument("--run-timeout-s", type=float, default=None,
                        help="kill a run (its whole process tree) after this many seconds and record it as timed out")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, metavar="JSON", help="only draw this JSON's PNG again")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--ratio", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot)
        return
    zoff_options = parse_options(args.zoff_option)
    if args.one:  # child: one run, result as the last stdout line
        result = run_one(args.one, args.model, args.accumulate[0], args.steps, args.warmup, args.batch, args.devices,
                         zoff_options, ratio=args.ratio, gpu_memory_gb=args.gpu_memory_gb, layers=args.layers,
                         checkpointing=args.activation_checkpointing)
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
    record = {"machine": machine, "command": shlex.join(["python", "scripts/bench.py", *sys.argv[1:]]),
              "gpu_memory_gb": args.gpu_memory_gb, "runs": runs}
    for accumulate in args.accumulate:
        for name in args.runs:
            if name == "deepspeed_zero3_offload_ratio":
                r = run_with_ratio_search(args, name, accumulate)
            else:
                r = run_child(args, name, accumulate, args.steps, args.warmup)
            runs.append(r)
            out.write_text(json.dumps(record, indent=1))  # a timeout keeps what ran
            if "error" in r:
                print(f"{name:>18} acc={accumulate} failed ({r['outcome']}): {r['error']}", file=sys.stderr, flush=True)
                continue
            print(f"{name:>18} acc={accumulate} step={r['step_s_median']:.3f}s tok/s={r['tokens_per_s']:.0f}"
                  f" fwd={r['forward_s']:.3f}s bwd={r['backward_s']:.3f}s exposed_opt={r['exposed_optimizer_s']:.3f}s"
                  f" peak_gpu={r['peak_gpu_gb']:.1f}GB host={r['host_gb']:.1f}GB", flush=True)
    compare(runs)
    print(f"\nmachine: {machine}\n{'run':>30} {'acc':>4} {'step s':>8} {'tokens/s':>10} {'fwd s':>7} {'bwd s':>7}"
          f" {'exposed opt s':>14} {'peak GPU GB':>12} {'host GB':>8} {'vs gpu_only':>12} {'vs DeepSpeed':>13}")

    def times(ratio: float | None) -> str:
        return f"{ratio:.2f}x" if ratio is not None else "-"

    for r in runs:
        label = r["name"] + (f" r={r['ratio']}" if r.get("ratio") is not None else "") + ("" if r["exact"] else "*")
        if "error" in r:
            print(f"{label:>30} {r['accumulate']:>4}  failed ({r['outcome']})")
            continue
        print(f"{label:>30} {r['accumulate']:>4} {r['step_s_median']:>8.3f} {r['tokens_per_s']:>10.0f}"
              f" {r['forward_s']:>7.3f} {r['backward_s']:>7.3f} {r['exposed_optimizer_s']:>14.3f}"
              f" {r['peak_gpu_gb']:>12.1f} {r['host_gb']:>8.1f} {times(r['vs_gpu_only']):>12}"
              f" {times(r['vs_best_exact_deepspeed']):>13}")
    references = {a: best_exact_deepspeed(runs, a) for a in args.accumulate}
    print("* inexact (not AdamW on every parameter every step in fp32 state); vs DeepSpeed: against the fastest"
          " exact DeepSpeed run at the same accumulation: "
          + (", ".join(f"acc {a}: {r['name']}" for a, r in references.items() if r) or "none ran"))
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    plot(record, out)


if __name__ == "__main__":
    main()
