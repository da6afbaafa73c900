"""LitGPT's own fine-tune scripts (issue 48) on a LitGPT config with random weights and a local instruction set
(nothing downloaded), under zoff and under the strategy LitGPT's `setup` picks, each run in a fresh process, side by
side: s/iter (LitGPT's own `iter_time`, the median after the warm-up), tokens/s, the GPU's peak, the process tree's peak
host memory, and how each run ended (`time`, `gpu_oom`, `host_oom`, `timeout`, `error`).

    python scripts/bench/bench_litgpt_scripts.py --model Llama-3.2-1B --seq 2048 --iters 20 --out litgpt_full.json
    python scripts/bench/bench_litgpt_scripts.py --model Llama-3-8B --script lora --strategies zoff litgpt ...

The scripts run as `setup` launches them (`litgpt.finetune.full.main` / `lora.main`, LitGPT's code), their Fabric made
here with the one line the guide changes (`ZoffFabricStrategy(state_dict_type="full")`) or LitGPT's own choice:
`"auto"` on one device, its `FSDPStrategy(...)` on several (`fsdp` forces that one on one device too). Each micro-batch
is one sample of `--seq` tokens. Needs `pip install --no-deps 'litgpt==0.5.13'` and tokenizers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from zoffbench.harness import RunFailure, outcome_of, report, run_function, zoff_lines
from zoffbench.results import write_result

STRATEGIES = ("zoff", "litgpt", "fsdp")
LORA = dict(lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_query=True, lora_value=True)


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-14m", help="a LitGPT config name (litgpt.Config.from_name)")
    parser.add_argument("--n-layer", type=int, default=None, help="override the config's number of layers")
    parser.add_argument("--script", default="full", choices=["full", "lora"])
    parser.add_argument("--strategies", nargs="+", default=["zoff", "litgpt"], choices=STRATEGIES)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--precision", default=None, help="default: bf16-mixed on CUDA, 32-true on CPU")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sample (max_seq_length)")
    parser.add_argument("--iters", type=int, default=20, help="optimizer steps, one micro-batch each")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the s/iter median")
    parser.add_argument("--run-timeout-s", type=float, default=600)
    parser.add_argument("--work", type=Path, default=None, help="where the checkpoint, data and outputs go")
    parser.add_argument("--out", type=Path, default=None,
                        help="the results JSON (default bench/results/<date>_<machine>_litgpt_<script>_<model>.json)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = options(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_litgpt_"))
    base, data, params = prepare(args.model, args.n_layer, args.seq, work)
    entries = []
    for strategy in args.strategies:
        kwargs = dict(script=args.script, strategy=strategy, devices=args.devices, precision=args.precision,
                      base=str(base), data=str(data), out=str(work / f"out_{strategy}"), seq=args.seq,
                      iters=args.iters)
        run = run_function(train, kwargs, output="capture", timeout_s=args.run_timeout_s, pss_interval_s=2.0)
        entry: dict[str, Any] = dict(script=args.script, model=args.model, n_layer=args.n_layer, params=params,
                                     strategy=strategy, devices=args.devices, seq=args.seq, iters=args.iters,
                                     wall_s=run.wall_s, host_tree_peak_gb=run.peak_tree_rss / 1e9,
                                     host_tree_peak_pss_gb=(run.peak_tree_pss or 0) / 1e9,
                                     zoff_lines=zoff_lines(run.stderr))
        result = run.results.get(0)
        if run.ok and result is not None:
            measured = result["iter_s"][args.warmup:] or result["iter_s"]
            s_per_iter = statistics.median(measured)
            entry.update(outcome="time", s_per_iter=s_per_iter, tokens_per_s=args.devices * args.seq / s_per_iter,
                         **result)
        else:
            error = run.failure()  # its one line, and the output before it (a CUDA error's cause is lines above)
            entry.update(RunFailure(error, outcome_of(error), run.stderr[-4000:] or run.stdout[-4000:]).fields())
        entries.append(entry)
        print(f"{strategy:>8}: {entry['outcome']}"
              + (f", {entry['s_per_iter']:.3f} s/iter, peak GPU {entry['peak_gpu_gb']:.1f} GB" if "s_per_iter" in entry
                 else f": {entry.get('error', '')}"))
    path = write_result({"runs": entries}, f"litgpt_{args.script}_{args.model.lower().replace('.', '')}", args.out)
    print(f"wrote {path}")
    return entries


def prepare(model: str, n_layer: int | None, seq: int, work: Path) -> tuple[Path, Path, int]:
    """The base checkpoint (bf16 weights drawn fast beyond a billion parameters) and instructions whose answers fill
    `seq` tokens; the config's parameter count."""
    import litgpt
    import torch

    from zoffbench import litgpt_inputs

    overrides = {} if n_layer is None else {"n_layer": n_layer}
    config = litgpt.Config.from_name(model, **overrides)
    with torch.device("meta"):
        params = sum(p.numel() for p in litgpt.GPT(config).parameters())
    base = litgpt_inputs.checkpoint_dir(work, config, dtype=torch.bfloat16 if params > 10**8 else torch.float32,
                                        fast_init=params > 10**9)
    data = litgpt_inputs.dataset(work, words=seq, samples=64)
    return base, data, params


def train(script: str, strategy: str, devices: int, precision: str | None, base: str, data: str, out: str, seq: int,
          iters: int) -> None:
    """In the child: LitGPT's `main` as its `setup` launches it, each logged step's `iter_time` reported by rank 0."""
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy
    from litgpt import Config
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import JSON
    from litgpt.finetune import full, lora
    from litgpt.model import Block

    from lightning_zoff import ZoffFabricStrategy

    cuda = torch.cuda.is_available()
    precision = precision or ("bf16-mixed" if cuda else "32-true")
    if script == "full":
        full.save_hyperparameters = lambda *args, **kwargs: None  # it parses sys.argv as LitGPT's CLI would
    else:  # `merge_lora` reads the LoRA settings back from what `save_hyperparameters` writes of LitGPT's command line
        sys.argv = ["litgpt", "finetune_lora", base, *(f"--{key}={value}" for key, value in LORA.items()),
                    f"--precision={precision}"]
    if strategy == "zoff":
        chosen: Any = ZoffFabricStrategy(state_dict_type="full")
    elif strategy == "fsdp" or devices > 1:  # LitGPT's own, as its setup builds it for several devices
        chosen = FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, state_dict_type="full",
                              limit_all_gathers=True, cpu_offload=False)
    else:
        chosen = "auto"
    fabric = Fabric(devices=devices, strategy=chosen, precision=precision)
    config = Config.from_file(Path(base) / "model_config.yaml")
    if script == "lora":
        from litgpt.lora import Config as LoraConfig

        config = LoraConfig.from_file(Path(base) / "model_config.yaml", **LORA)
    train_args = TrainArgs(save_interval=None, log_interval=1, global_batch_size=devices, micro_batch_size=1,
                           lr_warmup_steps=1, epochs=1000, max_steps=iters, max_seq_length=seq)
    evaluation = EvalArgs(interval=10**6, max_new_tokens=seq + 1, max_iters=1, initial_validation=False,
                          final_validation=False)
    logged: list[dict[str, float]] = []
    fabric.log_dict = lambda metrics, step=None: logged.append(dict(metrics))

    def run(fabric: Fabric) -> None:
        json_data = JSON(Path(data), val_split_fraction=0.05, num_workers=0)
        if script == "full":
            full.main(fabric, devices, False, 1337, config, json_data, Path(base), Path(out), train_args, evaluation,
                      "AdamW")
        else:
            lora.main(fabric, devices, 1337, config, json_data, Path(base), Path(out), train_args, evaluation, "AdamW",
                      1, precision)
        if fabric.global_rank == 0:
            report({"iter_s": [m["iter_time"] for m in logged if "iter_time" in m],
                    "losses": [float(m["loss"]) for m in logged if "loss" in m],
                    "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
                    "precision": precision}, rank=0)

    fabric.launch(run)


if __name__ == "__main__":
    main()
