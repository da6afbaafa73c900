"""The largest GPT (one width, layers varied) that trains on this machine, for zoff and DeepSpeed: predicted from the
memory plan, then tried: the predicted size and the next one up, and, should the predicted one fail, the ones below
until one trains. Each try is one scripts/bench/bench.py run in its own process (5 steps by default).

    python scripts/checks/find_largest.py --runs zoff zoff_bf16_moments
    python scripts/checks/find_largest.py --runs deepspeed_zero3_offload --layers 20 24   # DeepSpeed: the sizes given

Shape: `--model`'s width, heads, vocabulary and sequence (gpt13b: d=5120, 40 heads, seq 1024) at `--batch` 4. The
prediction (zoff runs) takes the host memory available now (less what a run's process holds before zoff plans, about
`--process-gb`) and the GPU's memory, and asks the plan for the most layers whose state fits both after "auto" placed
it, with the activations of activation checkpointing (which zoff turns on by itself there: `activation_checkpointing_
policy="auto"`) and the all-gathers, gradients and logits of one step (`step_bytes`). DeepSpeed has no prediction:
give its sizes with --layers (default: the zoff predictions and 20 layers).

Writes (results.write_result: `--out`, or bench/results/<date>_<machine>_largest.json) {"date", "machine",
"command", "largest": {run: params of the largest that trained, 0 if none}, "predicted": {run: layers, as predicted
before any try}, "tries": [bench entries with "layers", "params", "outcome" ("trained" or the failure's)]}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from zoffbench.harness import run_command
from zoffbench.model_shapes import MODEL_NAMES, model_shape
from zoffbench.results import ROOT, result_path, write_result

BENCH = ROOT / "scripts" / "bench" / "bench.py"
MOMENTS = {"zoff": 4, "zoff_bf16_moments": 2}


def gpt_params(cfg: dict, layers: int) -> int:
    d, vocab, seq = cfg["n_embd"], cfg["vocab_size"], cfg["block_size"]
    block = 12 * d * d + 2 * d  # attention 4 d^2, MLP 8 d^2, two LayerNorm weights (no biases)
    root = 2 * vocab * d + seq * d + d  # token embedding, LM head, positions, final norm
    return layers * block + root


def step_bytes(cfg: dict, layers: int, batch: int) -> int:
    """A step's accelerator memory besides the model and the optimizer state, with activation checkpointing: each
    block's input, one block's activations recomputed (17 tensors of tokens x width), the logits and their gradient,
    and the all-gathered parameters and unsharded gradients of two blocks in flight."""
    d, tokens, vocab = cfg["n_embd"], batch * cfg["block_size"], cfg["vocab_size"]
    block_params = 12 * d * d
    return 2 * tokens * d * layers + 34 * tokens * d + 8 * tokens * vocab + 4 * 2 * block_params


def predict_layers(cfg: dict, batch: int, moment_bytes: int, host_available: int, gpu_total: int) -> int:
    """The most layers whose optimizer state the memory plan fits beside `step_bytes` (0 if none)."""
    from lightning_zoff.placement import Machine, PlanDoesNotFit, StateOptions, UnitShape, margin_bytes, plan_memory

    options = StateOptions(param_bytes=2, moment_bytes=moment_bytes, moments=2, sum_bytes=0)
    machine = Machine(host_available, gpu_total)
    d = cfg["n_embd"]
    root = gpt_params(cfg, 0)
    best = 0
    for layers in range(1, 400):
        shapes = [UnitShape("model", root, root, True)]
        shapes += [UnitShape(f"model.blocks.{i}", 12 * d * d + 2 * d, 12 * d * d + 2 * d, True) for i in range(layers)]
        model_bytes = 2 * gpt_params(cfg, layers)
        try:  # "auto" at setup: the host holds all it can, the GPU the rest
            plan = plan_memory(shapes, options, machine, "auto", model_bytes=model_bytes,
                               masters_bytes=2 * model_bytes)
        except PlanDoesNotFit:
            break
        need = model_bytes + plan.accelerator_bytes + step_bytes(cfg, layers, batch) + margin_bytes(gpu_total)
        if need > gpu_total:
            break
        best = layers
    return best


def gpu_memory() -> int:
    """The GPU's memory less what a CUDA context takes, read without making one here (nvidia-smi)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) * 2**20 - 2**30


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
        how = (f"{entry['step_s_median']:.2f} s/step, host tree peak {entry.get('host_tree_peak_gb') or 0:.1f} GB,"
               f" GPU peak {entry['peak_gpu_gb']:.1f} GB")
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
    parser.add_argument("--step-layers", type=int, default=2, help="the next size up: this many layers more")
    parser.add_argument("--process-gb", type=float, default=6.0, help="host memory a run holds before zoff plans")
    parser.add_argument("--run-timeout-s", type=float, default=None)
    parser.add_argument("--predict-only", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import psutil

    cfg = model_shape(args.model)
    host = int(psutil.virtual_memory().available - args.process_gb * 1e9)
    gpu = gpu_memory()
    predicted = {run: predict_layers(cfg, args.batch, MOMENTS[run], host, gpu) for run in args.runs if run in MOMENTS}
    for run, layers in predicted.items():
        print(f"predicted: {run} {layers} layers ({gpt_params(cfg, layers) / 1e9:.2f}B) on {host / 1e9:.0f} GB of host"
              f" and {gpu / 2**30:.0f} GiB of GPU", flush=True)
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
