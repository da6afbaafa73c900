"""Time and host memory of saving and loading a sharded zoff checkpoint of a GPT: this tree's layout (one file per
rank) next to another source tree's, such as format version 1 (one torch.distributed.checkpoint file per tensor and
rank) of an older revision.

    python scripts/bench_checkpoint.py --model gpt7b --baseline 4b94f8b [--ranks 1] [--option accelerator_state=0.5]
    python scripts/bench_checkpoint.py --width 1024 --blocks 8 --baseline 4b94f8b   # a modest size, for the CPU

For each tree, two fresh processes (each starting its ranks, on the GPUs when CUDA is there): one trains a step and
saves (`trainer.save_checkpoint`, in `on_train_end`), the other resumes from the checkpoint (`fit(ckpt_path=...)`,
which loads and stops). In every rank a thread samples the resident memory (psutil, every 5 ms) while the save runs,
and while the strategy's `load_checkpoint` does; per rank come back the seconds, the RSS before and its peak above
that, and the optimizer state the rank holds on the host and on the accelerator. The checkpoint's files are counted,
then it is deleted (the disk must hold one: 12 B/param with fp32 moments, 8 with bf16). The load reads files the
save just wrote, mostly from the page cache, for both trees alike.

`--baseline` is a directory holding another `lightning_zoff/`, or a git revision of this repository, extracted with
`git archive` into the work directory. Prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# -- in the ranks (run with the tree measured first on PYTHONPATH) -----------------------------------------------


class Sampler:
    """Peak resident memory of this process while the block runs, sampled by a thread."""

    def __init__(self, interval_s: float = 0.005) -> None:
        import psutil

        self.process, self.interval_s = psutil.Process(), interval_s
        self.before = self.peak = self.after = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval_s)

    def __enter__(self) -> Sampler:
        self.before = self.peak = self.process.memory_info().rss
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.started
        self._stop.set()
        self._thread.join()
        self.after = self.process.memory_info().rss
        self.peak = max(self.peak, self.after)

    def result(self, **extra: object) -> dict:
        return {"seconds": self.seconds, "rss_before": self.before, "rss_peak": self.peak, "rss_after": self.after,
                "peak_above_before": self.peak - self.before, **extra}


def state_bytes(engine) -> dict:
    """The optimizer state this rank holds (fp32 masters and moments), by where it lives."""
    held = {"host": 0, "accelerator": 0}
    for state in engine.param_states():
        for tensor in [state.master, *state.moments.values()]:
            if tensor is not None:
                held["host" if tensor.device.type == "cpu" else "accelerator"] += tensor.numel() * tensor.element_size()
    return held


def child(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch

    from lightning_zoff import ZoffStrategy
    from lightning_zoff.examples.corpus import SyntheticDataModule
    from lightning_zoff.examples.gpt import GPTModule

    shape, options, ckpt, out = json.loads(args.shape), json.loads(args.options), Path(args.ckpt), Path(args.out_dir)
    gpu = torch.cuda.is_available()

    class SaveAtEnd(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            with Sampler() as sampled:
                trainer.save_checkpoint(ckpt)
            record(trainer, sampled.result(state=state_bytes(trainer.strategy.engine)))

    def record(trainer: pl.Trainer, result: dict) -> None:
        device = torch.cuda.get_device_name() if gpu else platform.processor() or platform.machine()
        result |= {"device": device, "torch": torch.__version__}
        (out / f"{args.child}_rank{trainer.global_rank}.json").write_text(json.dumps(result))

    strategy = ZoffStrategy(**options)
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="gpu" if gpu else "cpu", devices=args.ranks, strategy=strategy,
                         precision="bf16-mixed" if gpu else "32-true", max_steps=1, logger=False,
                         callbacks=[SaveAtEnd()] if args.child == "save" else [], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    if args.child == "load":
        load = strategy.load_checkpoint

        def measured_load(*a, **kw):
            with Sampler() as sampled:
                loaded = load(*a, **kw)
            record(trainer, sampled.result(state=state_bytes(strategy.engine)))
            return loaded

        strategy.load_checkpoint = measured_load  # type: ignore[method-assign]
    with trainer.init_module(empty_init=True):
        module = GPTModule(**shape)
    data = SyntheticDataModule(vocab_size=shape["vocab_size"], block_size=shape["block_size"], batch_size=1,
                               num_samples=args.ranks)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt if args.child == "load" else None)


# -- the parent: no torch here, so each child's memory is its own ----------------------------------------------


def source_tree(baseline: str, work: Path) -> Path:
    if (Path(baseline) / "lightning_zoff").is_dir():
        return Path(baseline).resolve()
    tree = work / f"tree_{baseline}"
    if not tree.exists():
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", baseline], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def measure(tree: Path, args: argparse.Namespace, shape: dict, options: dict, work: Path) -> dict:
    ckpt, out = work / "checkpoint", work / f"results_{tree.name}"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    run = {"tree": str(tree)}
    for phase in ("save", "load"):
        command = [sys.executable, str(Path(__file__).resolve()), "--child", phase, "--ranks", str(args.ranks),
                   "--shape", json.dumps(shape), "--options", json.dumps(options), "--ckpt", str(ckpt),
                   "--out-dir", str(out)]
        subprocess.run(command, env=env, check=True, cwd=work)
        run[phase] = [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(args.ranks)]
        if phase == "save":
            files = [f for f in ckpt.rglob("*") if f.is_file()]
            run["files"], run["bytes"] = len(files), sum(f.stat().st_size for f in files)
    shutil.rmtree(ckpt)
    return run


def table(runs: dict) -> str:
    def most(run: dict, phase: str, key: str) -> float:  # the slowest, or largest, rank
        return max(rank[key] for rank in run[phase])

    header = (f"{'layout (tree)':30} {'files':>6} {'GB':>7} {'state GB host/accel':>20} {'save s':>7}"
              f" {'save peak +GB':>13} {'load s':>7} {'load peak +GB':>13}")
    lines = [header]
    for name, run in runs.items():
        state = run["save"][0]["state"]
        held = f"{state['host'] / 1e9:.2f}/{state['accelerator'] / 1e9:.2f}"
        lines.append(f"{name:30} {run['files']:>6} {run['bytes'] / 1e9:>7.2f} {held:>20}"
                     f" {most(run, 'save', 'seconds'):>7.2f} {most(run, 'save', 'peak_above_before') / 1e9:>13.3f}"
                     f" {most(run, 'load', 'seconds'):>7.2f} {most(run, 'load', 'peak_above_before') / 1e9:>13.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GPT shape of scripts/bench.py's MODELS (gpt1b, gpt7b, ...)")
    parser.add_argument("--width", type=int, default=1024, help="without --model: n_embd")
    parser.add_argument("--blocks", type=int, default=8, help="without --model: n_layer")
    parser.add_argument("--seq", type=int, default=64, help="without --model: block_size")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--option", action="append", default=[], help="a ZoffStrategy option, key=value")
    parser.add_argument("--baseline", default=None, help="another source tree, or a git revision, to measure too")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write")
    for name in ("--child", "--shape", "--options", "--ckpt", "--out-dir"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import psutil

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench import MODELS, parse_options

    if args.model:
        shape = dict(MODELS[args.model])
    else:
        shape = dict(vocab_size=32000, block_size=args.seq, n_layer=args.blocks, n_head=max(args.width // 128, 1),
                     n_embd=args.width, bias=False)
    options = parse_options(args.option)
    work = Path(args.dir or tempfile.mkdtemp(prefix="zoff_bench_checkpoint_"))
    trees = {"rank files (this tree)": ROOT}
    if args.baseline:
        trees[f"baseline ({args.baseline})"] = source_tree(args.baseline, work)
    runs = {name: measure(tree, args, shape, options, work) for name, tree in trees.items()}
    machine = {"host": platform.node(), "cpus": os.cpu_count(), "memory_gb": psutil.virtual_memory().total / 1e9,
               "python": platform.python_version()}
    result = {"date": datetime.date.today().isoformat(), "model": args.model, "shape": shape, "ranks": args.ranks,
              "options": options, "baseline": args.baseline, "machine": machine, "runs": runs}
    print(table(runs))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
