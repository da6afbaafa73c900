"""Time and host memory of saving and loading a sharded zoff checkpoint of a GPT: this tree's layout (one file per
rank) next to another source tree's, such as a revision that writes format version 1 (one torch.distributed.checkpoint
file per tensor and rank).

    python scripts/bench/bench_checkpoint.py --model gpt7b --baseline 4b94f8b [--ranks 1] \
        [--option accelerator_state=0.5]
    python scripts/bench/bench_checkpoint.py --width 1024 --blocks 8 --baseline 4b94f8b   # a modest size, for the CPU

For each tree, two fresh processes (each starting its ranks, on the GPUs when CUDA is there): one trains a step and
saves (`trainer.save_checkpoint`, in `on_train_end`), the other resumes from the checkpoint (`fit(ckpt_path=...)`,
which loads and stops). In every rank a thread samples the resident memory (harness.RssSampler, every 5 ms) while
the save runs, and while the strategy's `load_checkpoint` does; per rank come back the seconds, the RSS before and its
peak above that, and the optimizer state the rank holds on the host and on the accelerator. The checkpoint's files are
counted, then it is deleted (the disk must hold one: 12 B/param with fp32 moments, 8 with bf16). The load reads files
the save just wrote, mostly from the page cache, for both trees alike.

`--baseline` is a directory holding another `lightning_zoff/`, or a git revision of this repository, extracted with
`git archive` into the work directory. Prints a table and writes JSON (results.write_result: `--out`, or
bench/results/<date>_<machine>_checkpoint_<model>_<ranks>ranks.json).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from zoffbench.harness import RssSampler, parse_options, report, run_function
from zoffbench.model_shapes import model_shape
from zoffbench.results import ROOT, write_result

# -- in the ranks (run with the tree measured first on PYTHONPATH) -----------------------------------------------


def sampled(rss: RssSampler, **extra: object) -> dict:
    """This process's memory while the block ran: the seconds, the RSS before and its peak above that."""
    return {"seconds": rss.seconds, "rss_before": rss.before, "rss_peak": rss.peak, "rss_after": rss.after,
            "peak_above_before": rss.peak - rss.before, **extra}


def state_bytes(engine) -> dict:
    """The optimizer state this rank holds (fp32 masters and moments), by where it lives."""
    held = {"host": 0, "accelerator": 0}
    for state in engine.param_states():
        for tensor in [state.master, *state.moments.values()]:
            if tensor is not None:
                held["host" if tensor.device.type == "cpu" else "accelerator"] += tensor.numel() * tensor.element_size()
    return held


def save_or_load(phase: str, ranks: int, shape: dict, options: dict, ckpt: str) -> None:
    """Train one step and save (`phase` "save"), or resume from the checkpoint (`phase` "load"); each rank reports what
    the save or the strategy's `load_checkpoint` took."""
    import lightning.pytorch as pl
    import torch

    from lightning_zoff import ZoffStrategy
    from lightning_zoff.examples.corpus import SyntheticDataModule
    from lightning_zoff.examples.gpt import GPTModule

    gpu = torch.cuda.is_available()

    class SaveAtEnd(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            with RssSampler(interval_s=0.005, tree=False) as rss:
                trainer.save_checkpoint(ckpt)
            record(trainer, sampled(rss, state=state_bytes(trainer.strategy.engine)))

    def record(trainer: pl.Trainer, result: dict) -> None:
        device = torch.cuda.get_device_name() if gpu else platform.processor() or platform.machine()
        report({**result, "device": device, "torch": torch.__version__}, rank=trainer.global_rank)

    strategy = ZoffStrategy(**options)
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="gpu" if gpu else "cpu", devices=ranks, strategy=strategy,
                         precision="bf16-mixed" if gpu else "32-true", max_steps=1, logger=False,
                         callbacks=[SaveAtEnd()] if phase == "save" else [], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    if phase == "load":
        load = strategy.load_checkpoint

        def measured_load(*a, **kw):
            with RssSampler(interval_s=0.005, tree=False) as rss:
                loaded = load(*a, **kw)
            record(trainer, sampled(rss, state=state_bytes(strategy.engine)))
            return loaded

        strategy.load_checkpoint = measured_load  # type: ignore[method-assign]
    with trainer.init_module(empty_init=True):
        module = GPTModule(**shape)
    data = SyntheticDataModule(vocab_size=shape["vocab_size"], block_size=shape["block_size"], batch_size=1,
                               num_samples=ranks)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt if phase == "load" else None)


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
    ckpt = work / "checkpoint"
    shutil.rmtree(ckpt, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    run = {"tree": str(tree)}
    for phase in ("save", "load"):
        kwargs = dict(phase=phase, ranks=args.ranks, shape=shape, options=options, ckpt=str(ckpt))
        ranks = run_function(save_or_load, kwargs, env=env, cwd=work).check().results
        run[phase] = [ranks[r] for r in range(args.ranks)]
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
    parser.add_argument("--model", default=None, help="a GPT of model_shapes.MODEL_NAMES (gpt1b, gpt7b, ...)")
    parser.add_argument("--width", type=int, default=1024, help="without --model: n_embd")
    parser.add_argument("--blocks", type=int, default=8, help="without --model: n_layer")
    parser.add_argument("--seq", type=int, default=64, help="without --model: block_size")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--option", action="append", default=[], help="a ZoffStrategy option, key=value")
    parser.add_argument("--baseline", default=None, help="another source tree, or a git revision, to measure too")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write (default: in bench/results/)")
    args = parser.parse_args()
    if args.model:
        shape = model_shape(args.model)
    else:
        shape = dict(vocab_size=32000, block_size=args.seq, n_layer=args.blocks, n_head=max(args.width // 128, 1),
                     n_embd=args.width, bias=False)
    options = parse_options(args.option)
    work = Path(args.dir or tempfile.mkdtemp(prefix="zoff_bench_checkpoint_"))
    trees = {"rank files (this tree)": ROOT}
    if args.baseline:
        trees[f"baseline ({args.baseline})"] = source_tree(args.baseline, work)
    runs = {name: measure(tree, args, shape, options, work) for name, tree in trees.items()}
    result = {"model": args.model, "shape": shape, "ranks": args.ranks, "options": options, "baseline": args.baseline,
              "runs": runs}
    print(table(runs))
    what = f"checkpoint_{args.model or f'w{args.width}_b{args.blocks}'}_{args.ranks}ranks"
    print(f"wrote {write_result(result, what, args.out)}")


if __name__ == "__main__":
    main()
