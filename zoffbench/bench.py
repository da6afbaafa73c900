"""scripts/bench/bench.py: side-by-side step time of offloaded and GPU-only training, one subprocess per run, one
harness for all.

The commands: scripts/bench/bench.py, its entry point.

Without --runs: gpu_only, zoff, DeepSpeed's four configurations (zoffbench/deepspeed_runs.py: ZeRO-3 and ZeRO-2
with the optimizer on the CPU, ZeRO-3 with part of the optimizer on the GPU (`offload_optimizer.ratio`), ZeRO-2 +
ZenFlow) and fsdp2_cpu_offload (FSDP2's own CPUOffloadPolicy); --runs takes the zoff variants too, fsdp_cpu_offload
(Lightning's FSDPStrategy(cpu_offload=True), GPU only) and torchao_cpu_offload (torchao's CPUOffloadOptimizer, its
own plain loop, never clipped: zoffbench/torchao_run.py). A run that cannot run here (torchao missing, no GPU, ZenFlow
at an accumulation it refuses, clipping asked of torchao) is an entry with outcome "unsupported" and the reason.

`--config NAME` takes a peer's headline configuration (zoffbench/configs.py: `megatrain_qwen25_7b`, MegaTrain's
Qwen2.5-7B at seq 1024, batch 8 x 18, 4 loader workers, every block recomputed) as the defaults of the arguments it
names; the JSON records it under "config".

zoff runs build the model on the meta device (`trainer.init_module(empty_init=True)`: each rank initialises only its
own units, so the host never holds the whole fp32 model next to the masters); DeepSpeed's ZeRO-3 runs build it in
`configure_model` under `deepspeed.zero.Init` (partitioned as it is created), its ZeRO-2 runs as usual (ZeRO-2 keeps
the whole 16-bit model on every GPU); the FSDP runs on the CPU, where their CPU offload keeps the parameters
(zoffbench/fsdp_runs.py). `--activation-checkpointing` recomputes every run's blocks (zoffbench/recompute.py).
`--zoff-option key=value` (repeatable) sets ZoffStrategy options of every zoff run, over the variant's own.

deepspeed_zero3_offload_ratio searches `--ratios` (0.1, 0.2, ..., 1.0) for the smallest fraction of the optimizer on
the CPU that fits (the least host traffic, so the fastest): each try trains 2 steps in its own process; a larger ratio
needs less GPU memory and more host memory, so the ratios that fit form one interval: the smallest ratio is tried
first, then a bisection of the others finds the interval's low end (5 tries at most; a try that runs the GPU out of
memory goes up, one that runs the host out goes down, any other failure ends the search). The ratio found then runs
the whole measurement. One value in --ratios skips the search.

Every run trains on random token ids of the model's vocabulary, `--batch` x `--seq` (default: the model's block_size)
a batch, from a torch DataLoader with `--num-workers` loader processes (persistent; default 4 for llama3_8b and
qwen3_14b, the users' models at seq 4096, and qwen25_7b, MegaTrain's, else 0: batches made in the training process;
zoffbench/data.py).

`--gpu-memory-gb N` emulates a smaller GPU: each run's process caps torch's allocator at N GiB
(`torch.cuda.set_per_process_memory_fraction`) before anything is built. The CUDA context, NCCL's and DeepSpeed's own
buffers outside torch's allocator are not counted, and `torch.cuda.mem_get_info` still reports the whole GPU.

Prints a table and writes bench/results/<date>_<machine>_bench_<model>.json (results.write_result; bench/README.md
collects them) and the same name with .png (zoffbench/plot.py: each run's step split into forward, backward and exposed
optimizer time; peak GPU and host memory): {"date", "machine", "command", "config" (--config's preset, or null),
"gpu_memory_gb", "runs": [{"name", "model",
"accumulate", "batch", "seq", "num_workers", "gpu_memory_gb" (null: uncapped), "exact" (false: not AdamW's update of
every parameter at every step, e.g. ZenFlow, bf16 moments), "step_s_median", "step_s_mean", "tokens_per_s",
"forward_s", "backward_s", "exposed_optimizer_s", "peak_gpu_gb", "host_gb", "host_tree_peak_gb",
"host_tree_peak_pss_gb", "setup_s" (the process's start to its first step), "params", "vs_gpu_only",
"vs_best_exact_deepspeed", ...}, ...]}. DeepSpeed runs add "deepspeed_config" (the dict DeepSpeed got), the ratio run
"ratio" and "ratio_tries" (each try's ratio, outcome and error). A run that fails keeps its entry, with "error" (the
failure's last meaningful line), "outcome" ("gpu_oom",
"host_oom", "timeout" or "error") and "stderr_tail" instead of the measurements. A run measures when its training
ends, before its teardown: one cut by its limit after that keeps its measurement, with "cut_after_measuring" (the
limit it ran past) and "exit_s" (from the measurement to its end). `--add-to JSON` puts an earlier call's
runs (the same --config on the same kind of machine) first and names that call under "earlier_calls": a preset whose
peers cannot all run within one call's time still gives one JSON with every peer's outcome.

"exposed_optimizer_s" is the median wall time from the end of the window's last backward (after clipping) to the end
of the optimizer step: the time the GPU waits for the update; zoff reports its own, which also counts the forwards
that waited for an overlapped update. "forward_s" (batch start to the loss) and "backward_s" (the loss to
on_after_backward) are summed over the window's micro-batches, timed by CUDA events on the current stream (zoff: its
own telemetry, which moves those waits out of the forward). "host_tree_peak_gb" is the peak resident memory of the
run's whole process tree, sampled every 0.5 s (ZenFlow updates in a process of its own; pinned and shared memory count
in every process that maps it, a forked loader worker its parent's pages too); "host_tree_peak_pss_gb" is the peak of
the tree's summed PSS (each shared page once: the honest figure of a tree with loader workers), sampled every 2 s
("pss_read_s": the longest pass, which the bench's own process spends walking the tree's page tables); "host_gb" is
rank 0's own peak. zoff runs add the plan's host figures (its memory report, in "memory"): "plan_host_gb" (the host
state it planned), "plan_host_capacity_gb" (what it may hold: the host's available memory less a reserve for the rest
of the process), "tree_pss_beyond_plan_gb" (what the tree held besides: Python, CUDA, loader workers, ...),
"tree_pss_within_plan_capacity" (the whole tree within what zoff's state may hold: a strict bound),
"plan_host_available_gb" (the host's available memory at setup, as the plan read it: zoff's capacity and what it kept
for the rest of the tree) and "tree_pss_within_plan" (the whole tree within it: the plan's promise; the state
`plan_host_gb` is the memory report after "auto"'s moves, so it can be less than the tree held at setup).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zoffbench import configs
from zoffbench.deepspeed_runs import DEEPSPEED_RUNS, RATIOS
from zoffbench.harness import RunFailure, outcome_of, run_function, zoff_lines
from zoffbench.model_shapes import MODEL_NAMES
from zoffbench.results import describe, machine, result_path, write_result
from zoffbench.runs import DEFAULT_RUNS, RUNS, bench_run, run_one, unsupported_here

# the models a user's job feeds through loader processes (seq 4096; MegaTrain's Qwen2.5-7B at 1024): --num-workers'
# default; 0 for the others
LOADER_WORKERS = {"llama3_8b": 4, "qwen3_14b": 4, "qwen25_7b": 4}
# a PSS pass walks the page tables of every process of the tree (about 10 ms per resident GB each), in the bench's
# own process: seconds apart, and each entry's "pss_read_s" says how long the longest took
PSS_INTERVAL_S = 2.0


def plan_against_tree(memory: dict | None, devices: int, tree_pss: int | None) -> dict:
    """A zoff run's host plan (rank 0's memory report; the node's ranks hold equal shares) beside its tree's measured
    peak PSS: what zoff planned to hold, what it may hold (the host's available memory less a reserve for the rest of
    each process), and whether the whole tree stayed within the latter."""
    if not memory or "host_total" not in memory:
        return {}
    planned, capacity = devices * memory["host_total"], devices * memory["host_capacity"]
    available = capacity + devices * memory.get("host_kept", 0)
    figures = {"plan_host_gb": planned / 1e9, "plan_host_capacity_gb": capacity / 1e9,
               "plan_host_available_gb": available / 1e9}
    if tree_pss:
        figures |= {"tree_pss_beyond_plan_gb": (tree_pss - planned) / 1e9,
                    "tree_pss_within_plan_capacity": tree_pss <= capacity,
                    "tree_pss_within_plan": tree_pss <= available}
    return figures


def run_child(args: argparse.Namespace, name: str, accumulate: int, steps: int, warmup: int,
              ratio: float | None = None) -> dict:
    """One run in a process of its own (CUDA, DeepSpeed's globals and the host memory start fresh each time): its
    result, or its entry with "error", "outcome" and the tail of its stderr."""
    run = bench_run(name, args.model, accumulate, args.batch, args.zoff_option, args.gpu_memory_gb, args.layers,
                    args.activation_checkpointing, ratio, args.clip, args.seq, args.num_workers, args.data)
    refusal = unsupported_here(name, accumulate, args.clip_asked, machine()["gpus"])
    if refusal:
        return run.entry(**RunFailure(refusal, "unsupported").fields())
    kwargs = dict(name=name, model_name=args.model, accumulate=accumulate, steps=steps, warmup=warmup,
                  batch=args.batch, devices=args.devices, zoff_option=args.zoff_option, ratio=ratio,
                  gpu_memory_gb=args.gpu_memory_gb, layers=args.layers, checkpointing=args.activation_checkpointing,
                  clip=args.clip, seq=args.seq, num_workers=args.num_workers, data=args.data)
    limits = args.run_timeout_s
    child = run_function(run_one, kwargs, output="capture", timeout_s=limits.get(name, limits.get(None)),
                         pss_interval_s=PSS_INTERVAL_S)
    pss = child.peak_tree_pss or None  # 0: the run ended before the first pass
    host: dict[str, Any] = {"host_tree_peak_gb": child.peak_tree_rss / 1e9,
                            "host_tree_peak_pss_gb": pss / 1e9 if pss else None, "pss_read_s": child.pss_read_s,
                            "wall_s": child.wall_s}
    # rank 0's: the other ranks measured their own share. A run reports when its training ends, before the teardown:
    # one cut by its limit after that keeps its measurement, and says so
    if 0 in child.results and (child.ok or child.timed_out):
        measured = child.results[0]
        if "reported_at" in measured:  # the process's end after its measurement: teardown and exit
            host["exit_s"] = child.ended_at - measured["reported_at"]
        if child.timed_out:
            host["cut_after_measuring"] = child.failure()
        return {**measured, **host, **plan_against_tree(measured.get("memory"), args.devices, pss),
                "zoff_lines": zoff_lines(child.stderr)}
    error = child.failure()
    return run.entry(**RunFailure(error, outcome_of(error), child.stderr[-2000:]).fields(), **host)


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
        run = bench_run(name, args.model, accumulate, args.batch, args.zoff_option, args.gpu_memory_gb, args.layers,
                        args.activation_checkpointing, clip=args.clip, seq=args.seq, num_workers=args.num_workers,
                        data=args.data)
        failure = RunFailure(f"no ratio in {ratios} fits: {last['error']}", last["outcome"])
        return run.entry(ratio=None, ratio_tries=tries, **failure.fields())
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


def between(run: dict) -> str:
    """Of a zoff run's `other`, the part its accelerator spent between zoff's phases (`StepTimer`'s "between": the
    loop's own work between micro-batches and at the window's edges); empty for runs without zoff's telemetry."""
    seconds = (run.get("telemetry_median") or {}).get("zoff/between_s")
    return "" if seconds is None else f" (between phases {seconds:.3f}s)"


def paused(run: dict) -> str:
    """A warning where measured steps followed a placement pause (`harness.after_placement_pause`): their time flatters
    the run; a larger --warmup measures past them."""
    steps = run.get("after_placement_pause")
    if not steps:
        return ""
    times = ", ".join(f"{run['steps'][i]:.3f}s" for i in steps)
    return (f"\n{'':>18} note: step(s) {steps} follow a placement pause (their first forward met no host update):"
            f" {times}; a larger --warmup measures past them")


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
    from zoffbench.plot import plot_runs

    title = f"{record['command']}\n{describe(record['machine'])}"
    if plot_runs(record["runs"], out.with_suffix(".png"), title) is not None:
        print(f"wrote {out.with_suffix('.png')}")


def run_limit(value: str) -> tuple[str | None, float]:
    """--run-timeout-s's `SECONDS` (every run) or `RUN=SECONDS` (that run's own)."""
    name, _, seconds = value.rpartition("=")
    if name and name not in RUNS:
        raise argparse.ArgumentTypeError(f"{name!r} is no run; runs: {', '.join(RUNS)}")
    return name or None, float(seconds)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """bench.py's arguments: a preset's (--config) where the command line gives none of its own."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", choices=sorted(configs.CONFIGS), default=None,
                        help="a peer's headline configuration: a preset of the arguments below (zoffbench/configs.py);"
                             " an argument given as well wins")
    parser.add_argument("--model", choices=MODEL_NAMES, default="gpt1b")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(DEFAULT_RUNS))  # DeepSpeed: its wheel
    parser.add_argument("--accumulate", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="per device")
    parser.add_argument("--seq", type=int, default=None, help="tokens a sequence (default: the model's block_size)")
    parser.add_argument("--num-workers", type=int, default=None, metavar="N",
                        help="the training DataLoader's worker processes (default: 4 for "
                             f"{', '.join(LOADER_WORKERS)}, else 0: batches made in the training process)")
    parser.add_argument("--data", choices=["random", "text"], default="random",
                        help="random tokens (every step clips at 1.0) or text: the main job's corpus, byte tokens,"
                             " whose gradient norm falls under the clip once training is past its warm-up")
    parser.add_argument("--devices", type=int, default=1, help="GPUs per run (ranks of one node)")
    parser.add_argument("--zoff-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a ZoffStrategy option for the zoff runs, e.g. overlap=False (repeatable)")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, metavar="N",
                        help="cap every run's GPU memory at N GiB (emulates a smaller GPU)")
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS),
                        help="offload_optimizer.ratio values deepspeed_zero3_offload_ratio searches (one: no search)")
    parser.add_argument("--layers", type=int, default=None, help="the GPT's blocks, instead of the model's own")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="every run recomputes each block's activations in backward")
    parser.add_argument("--clip", type=lambda v: "none" if v in ("none", "0") else float(v), default=None,
                        metavar="NORM",
                        help="the Trainer's gradient_clip_val (default 1.0); 'none': no clipping (torchao's run never"
                             " clips, and is refused where --clip NORM is given)")
    parser.add_argument("--run-timeout-s", type=run_limit, nargs="+", default=[], metavar="[RUN=]SECONDS",
                        help="kill a run (its whole process tree) after this many seconds and record it as timed out;"
                             " RUN=SECONDS for that run alone")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--add-to", type=Path, default=None, metavar="JSON",
                        help="an earlier call's JSON of the same --config on the same kind of machine: its runs come"
                             " first in this call's JSON and table (a preset whose peers need more than one call)")
    parser.add_argument("--plot", type=Path, default=None, metavar="JSON", help="only draw this JSON's PNG again")
    preset = parser.parse_known_args(argv)[0].config
    if preset:
        parser.set_defaults(**configs.arguments(preset))
    args = parser.parse_args(argv)
    args.run_timeout_s = dict(args.run_timeout_s)  # run name (None: every other run) -> seconds
    args.clip_asked = isinstance(args.clip, float)  # a norm given on the command line, not the default's
    if args.clip is None:
        args.clip = 1.0
    elif args.clip == "none":
        args.clip = None
    if args.num_workers is None:
        args.num_workers = LOADER_WORKERS.get(args.model, 0)
    return args


def earlier_call(path: Path, record: dict) -> dict:
    """--add-to: the runs of the earlier call at `path` and where they came from ("earlier_calls"), refused in one line
    unless that call ran the same config (`record`'s) on the same kind of machine (GPU, count, cores, host memory)."""
    earlier = json.loads(path.read_text())
    same = ("gpu", "gpus", "cores")
    here, there = machine(), earlier.get("machine") or {}
    if isinstance(there, str) or any(here[key] != there.get(key) for key in same) or abs(
            here["host_memory_gb"] - there.get("host_memory_gb", 0)) > 2:
        raise SystemExit(f"--add-to {path}: its runs were made on {describe(there)}, this call runs on"
                         f" {describe(here)}: add only calls made on the same kind of machine")
    if earlier.get("config") != record["config"] or earlier.get("gpu_memory_gb") != record["gpu_memory_gb"]:
        name = (earlier.get("config") or {}).get("name")
        raise SystemExit(f"--add-to {path}: its runs used --config {name} and --gpu-memory-gb"
                         f" {earlier.get('gpu_memory_gb')}: give this call the same")
    calls = [*earlier.get("earlier_calls", []), {key: earlier.get(key) for key in ("date", "machine", "command")}]
    return {"earlier_calls": calls, "runs": list(earlier["runs"])}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot)
        return
    out = args.out or result_path(f"bench_{args.model}")  # once: every write goes to the same file
    record = {"config": configs.record(args.config), "gpu_memory_gb": args.gpu_memory_gb, "runs": []}
    if args.add_to:
        record |= earlier_call(args.add_to, record)
    runs: list[dict] = record["runs"]
    for accumulate in args.accumulate:
        for name in args.runs:
            if name == "deepspeed_zero3_offload_ratio":
                r = run_with_ratio_search(args, name, accumulate)
            else:
                r = run_child(args, name, accumulate, args.steps, args.warmup)
            runs.append(r)
            write_result(record, "bench", out)  # a timeout keeps what ran
            if "error" in r:
                print(f"{name:>18} acc={accumulate} failed ({r['outcome']}): {r['error']}", file=sys.stderr, flush=True)
                continue
            print(f"{name:>18} acc={accumulate} step={r['step_s_median']:.3f}s tok/s={r['tokens_per_s']:.0f}"
                  f" fwd={r['forward_s']:.3f}s bwd={r['backward_s']:.3f}s exposed_opt={r['exposed_optimizer_s']:.3f}s"
                  f" other={r['other_s']:.3f}s{between(r)} busy={r['gpu_busy_fraction']:.0%}"
                  f" TFLOP/s={r['model_tflops']:.0f}"
                  f" peak_gpu={r['peak_gpu_gb']:.1f}GB active={r.get('peak_gpu_active_gb') or 0:.1f}GB"
                  f" reserved={r['peak_gpu_reserved_gb']:.1f}GB host={r['host_gb']:.1f}GB{paused(r)}", flush=True)
    compare(runs)
    print(f"\nmachine: {describe(machine())}\n{'run':>30} {'acc':>4} {'step s':>8} {'tokens/s':>10} {'fwd s':>7}"
          f" {'bwd s':>7} {'exposed opt s':>14} {'peak GPU GB':>12} {'host GB':>8} {'vs gpu_only':>12}"
          f" {'vs DeepSpeed':>13}")

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
    inexact = any(not r["exact"] for r in runs)  # the legend of a "*" only where a label has one
    print(("* inexact (not AdamW on every parameter every step in fp32 state: bf16 moments); " if inexact else "")
          + "vs DeepSpeed: against the fastest exact DeepSpeed run at the same accumulation: "
          + (", ".join(f"acc {a}: {r['name']}" for a, r in references.items() if r) or "none ran"))
    write_result(record, "bench", out)
    print(f"wrote {out}")
    plot(json.loads(out.read_text()), out)

