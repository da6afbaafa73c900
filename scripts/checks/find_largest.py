"""The largest GPT (one width, layers varied) that trains on this machine, for zoff and DeepSpeed: predicted from the
memory plan, then tried: the predicted size and the next one up, and, should the predicted one fail, the ones below
until one trains. Each try is one scripts/bench/bench.py run in its own process (5 steps by default).

    python scripts/checks/find_largest.py --runs zoff zoff_bf16_moments
    python scripts/checks/find_largest.py --runs deepspeed_zero3_offload --layers 20 24   # DeepSpeed: the sizes given

Shape: `--model`'s width, heads, vocabulary and sequence (gpt13b: d=5120, 40 heads, seq 1024) at `--batch` 4. The
prediction (zoff runs) takes the host memory available now (less what a run's process holds before zoff plans, about
`--process-gb`; or ZOFF_HOST_MEMORY_BYTES, which every run's plan then takes too) and the GPU's memory as a run's
setup reads it (in a child process: no CUDA context stays here to take memory from the runs), and asks zoff's
own plan for the most layers whose state and step fit after "auto" placed it: the step as zoff traces it at setup
(`placement/step_trace.py`, blocks recomputed as "auto" does at these sizes), traced at 6 and 8 layers and taken as
linear in the layers, with FSDP2's buffers at each size. The run above the prediction should be refused at setup by the
same plan, in one line. DeepSpeed has no prediction: give its sizes with --layers (default: the zoff predictions and 20
layers).

Writes (results.write_result: `--out`, or bench/results/<date>_<machine>_largest.json) {"date", "machine",
"command", "largest": {run: params of the largest that trained, 0 if none}, "predicted": {run: layers, as predicted
before any try}, "tries": [bench entries with "layers", "params", "outcome" ("trained" or the failure's)]}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import multiprocessing
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from lightning_zoff.examples.gpt import GPTModule
from lightning_zoff.placement import Machine, PlanDoesNotFit, StateOptions, StepProbe, UnitShape, plan_memory
from lightning_zoff.placement.fsdp_buffers import UnitBuffers
from lightning_zoff.placement.machine import accelerator_capacity
from lightning_zoff.placement.plan import REDUCED_IN_FLIGHT, StepMemory
from lightning_zoff.placement.rank import gathered_bytes, in_forward_order, unit_shapes_before_sharding
from lightning_zoff.placement.step_trace import trace_step_work
from lightning_zoff.sharding import block_classes, checkpoint_activations
from lightning_zoff.units import forward_order, plan_units
from zoffbench.harness import run_command
from zoffbench.model_shapes import MODEL_NAMES, model_shape
from zoffbench.results import ROOT, result_path, write_result

BENCH = ROOT / "scripts" / "bench" / "bench.py"
MOMENTS = {"zoff": 4, "zoff_bf16_moments": 2}
# the sizes the step is traced at: FSDP2's buffers stop growing past REDUCED_IN_FLIGHT + 2 units (the reduced shards)
TRACED = (REDUCED_IN_FLIGHT + 4, REDUCED_IN_FLIGHT + 6)


def gpt_params(cfg: dict, layers: int) -> int:
    d, vocab, seq = cfg["n_embd"], cfg["vocab_size"], cfg["block_size"]
    block = 12 * d * d + 2 * d  # attention 4 d^2, MLP 8 d^2, two LayerNorm weights (no biases)
    root = 2 * vocab * d + seq * d + d  # token embedding, LM head, positions, final norm
    return layers * block + root


def traced_step(cfg: dict, layers: int, batch: int, device: torch.device) -> StepMemory:
    """The product's trace of the bench GPT's step at `layers` layers and `batch` (`placement/step_trace.py`), its
    blocks recomputed, as "auto" does at these sizes (the GPU cannot hold all their state beside the step), with
    FSDP2's share from the units' sizes: what zoff's plan counts at setup. The model is built on the meta device."""
    with torch.device("meta"):
        module = GPTModule(**{**cfg, "n_layer": layers})
    units = plan_units(module)
    checkpoint_activations(module, block_classes(units))
    seq = cfg["block_size"]
    tokens = torch.zeros(batch, seq, dtype=torch.long)
    autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
    probe = StepProbe(lambda: (tokens, tokens), lambda b: module.model(*b)[1], autocast)
    buffers = UnitBuffers.of(module, units, 2, forward_order(module, units))
    work = trace_step_work(module, probe, (tokens, tokens), device, torch.bfloat16, buffers)
    return StepMemory(work.activations, buffers.most, f"a batch of {batch} x {seq}", samples=batch,
                      together=work.together)


def planned_units(cfg: dict, layers: int) -> tuple[list[UnitShape], int, int]:
    """The GPT's units at `layers` as setup plans them (one rank, 16-bit shards), in forward order, the bytes of its
    shards and FSDP2's share of the step: from a model on the meta device."""
    with torch.device("meta"):
        module = GPTModule(**{**cfg, "n_layer": layers})
    units = plan_units(module)
    shapes, model_bytes = unit_shapes_before_sharding(module, units, 1, 2)
    order = forward_order(module, units)
    return in_forward_order(shapes, order), model_bytes, gathered_bytes(module, units, 2, order)


def predict_layers(cfg: dict, batch: int, moment_bytes: int, host_available: int, gpu_total: int,
                   device: torch.device) -> int:
    """The most layers whose optimizer state and step the memory plan fits (0 if none): the plan zoff makes at setup,
    with the step traced at two sizes and taken as linear in the layers beyond (the blocks repeat): sizes where FSDP2's
    buffers have stopped growing (`TRACED`: more units than the reduced shards it holds at once), so that both the
    activations and the most held at one moment grow by one block's activations a layer."""
    # the defaults' options: the GPU's share of the host's updates takes its slots there
    options = StateOptions(param_bytes=2, moment_bytes=moment_bytes, moments=2, sum_bytes=0, update_share="auto")
    machine = Machine(host_available, gpu_total)
    small, large = (traced_step(cfg, layers, batch, device) for layers in TRACED)
    per_layer = (large.activations - small.activations) / (TRACED[1] - TRACED[0])
    per_layer_together = (large.together - small.together) / (TRACED[1] - TRACED[0])
    best = 0
    for layers in range(1, 400):
        shapes, model_bytes, gathered = planned_units(cfg, layers)
        grown = layers - TRACED[1]
        step = replace(large, activations=int(large.activations + grown * per_layer), gathered=gathered,
                       together=int(large.together + grown * per_layer_together))
        try:  # "auto" at setup: the host holds all it can, the GPU the rest beside the step
            plan_memory(shapes, options, machine, "auto", model_bytes=model_bytes, masters_bytes=2 * model_bytes,
                        step=step)
        except PlanDoesNotFit:
            break
        best = layers
    return best


def predict_in_a_child(cfg: dict, batch: int, moments: dict[str, int], host_available: int) -> tuple[int, dict]:
    """The GPU's capacity as a run reads it and the predicted layers of each run (`moments`: run -> moment bytes),
    found in a child process: a CUDA context here would stay for the search and take its memory from every run it
    starts (1x H100, 2026-12-07: the runs planned with 0.55 GB less than the prediction's `total - 1 GiB`, and the
    predicted 49 layers with bf16 moments were refused by 0.1 GB)."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(_predict, cfg, batch, moments, host_available).result()


def _predict(cfg: dict, batch: int, moments: dict[str, int], host_available: int) -> tuple[int, dict]:
    cuda = torch.device("cuda")
    torch.cuda.init()
    gpu = accelerator_capacity(cuda)  # before anything is allocated, as a run's setup reads it
    return gpu, {run: predict_layers(cfg, batch, m, host_available, gpu, cuda) for run, m in moments.items()}


def try_size(args: argparse.Namespace, run: str, layers: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "try.json"
        cmd = [sys.executable, str(BENCH), "--model", args.model, "--layers", str(layers), "--batch", str(args.batch),
               "--accumulate", "1", "--steps", str(args.steps), "--warmup", str(args.warmup), "--runs", run,
               "--out", str(out)]
        if args.run_timeout_s:
            cmd += ["--run-timeout-s", str(args.run_timeout_s)]
        run_command(cmd)
        entry = json.loads(out.read_text())["runs"][0] if out.exists() else {"error": "bench.py wrote nothing"}
    entry.update(layers=layers, params=gpt_params(model_shape(args.model), layers),
                 outcome=entry.get("outcome", "trained") if "error" in entry else "trained")
    if entry["outcome"] == "trained":
        retries = sum(entry.get("gpu_alloc_retries_per_step") or [])
        planned_step = (entry.get("memory") or {}).get("accelerator_step", 0) / 1e9
        how = (f"{entry['step_s_median']:.2f} s/step, host tree peak {entry.get('host_tree_peak_gb') or 0:.1f} GB,"
               f" GPU peak {entry['peak_gpu_gb']:.1f} GB (active {entry.get('peak_gpu_active_gb') or 0:.1f}, reserved"
               f" {entry.get('peak_gpu_reserved_gb') or 0:.1f}), {retries} allocator retries, the plan's step"
               f" {planned_step:.1f} GB")
    else:
        how = str(entry.get("error"))
    print(f"{run} {layers} layers ({entry['params'] / 1e9:.2f}B): {entry['outcome']}: {how}", flush=True)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=[m for m in MODEL_NAMES if "hf" not in model_shape(m)], default="gpt13b")
    parser.add_argument("--runs", nargs="+", default=["zoff", "zoff_bf16_moments"])
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="the sizes DeepSpeed runs try")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--step-layers", type=int, default=1, help="the next size up: this many layers more")
    # 1x H200, 2026-12-07: the bench's child planned with 1.0 to 3.0 GB less available than this process read before
    parser.add_argument("--process-gb", type=float, default=2.0, help="host memory a run holds before zoff plans")
    parser.add_argument("--run-timeout-s", type=float, default=None)
    parser.add_argument("--predict-only", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import psutil

    cfg = model_shape(args.model)
    # ZOFF_HOST_MEMORY_BYTES, where set, is what every run's plan takes as available (a calibration: the plan with
    # more or less host than the machine has); the prediction takes it as they will
    overridden = int(os.environ.get("ZOFF_HOST_MEMORY_BYTES", 0))
    host = overridden or int(psutil.virtual_memory().available - args.process_gb * 1e9)
    gpu, predicted = predict_in_a_child(cfg, args.batch, {run: MOMENTS[run] for run in args.runs if run in MOMENTS},
                                        host)
    for run, layers in predicted.items():
        print(f"predicted: {run} {layers} layers ({gpt_params(cfg, layers) / 1e9:.2f}B) on {host / 1e9:.0f} GB of host"
              f" and {gpu / 1e9:.1f} GB of GPU", flush=True)
    if args.predict_only:
        return
    out = args.out or result_path("largest")  # once: every write goes to the same file
    record: dict = {"host_available_gb": host / 1e9, "gpu_gb": gpu / 1e9, "predicted": predicted, "tries": [],
                    "largest": {}}
    for run in args.runs:
        sizes = [predicted[run], predicted[run] + args.step_layers] if run in predicted else (args.layers or [20])
        trained, downs, below = 0, 0, predicted.get(run)
        while sizes:
            layers = sizes.pop(0)
            entry = try_size(args, run, layers)
            record["tries"].append({"run": run, **entry})
            if entry["outcome"] == "trained":
                trained = max(trained, entry["params"])
            elif run in predicted and layers == below and layers > args.step_layers and downs < 2:
                # the prediction (kept as it was made) was too much: the size below, twice at most
                below, downs = layers - args.step_layers, downs + 1
                sizes = [below]
            write_result(record, "largest", out)
        key = "deepspeed" if run.startswith("deepspeed") else run
        record["largest"][key] = max(record["largest"].get(key, 0), trained)
        write_result(record, "largest", out)
    print("largest:", {run: f"{params / 1e9:.2f}B" for run, params in record["largest"].items()}, f"wrote {out}")


if __name__ == "__main__":
    main()
