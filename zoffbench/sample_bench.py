"""Memory and time of no-grad forwards and of sampling after a training step: zoff next to DDP, 2 CPU ranks.

    python scripts/bench/bench_sample.py                             # gpt_125m's shape, zoff and ddp
    python scripts/bench/bench_sample.py --runs zoff --label before  # one run, named in the output file

Each run is a subprocess that forks its 2 ranks (gloo), trains one step (batch 2 x 64 tokens, synthetic data, 32-true)
and then, in every rank:
  same_shape  41 no-grad forwards of 1 x 64 tokens
  growing     40 no-grad forwards of 1 x 1..40 tokens (what a generation without a cache runs)
  sample      `sample(b"def ", 60, temperature=0.8, top_k=50)`, as scripts/train.py samples at the end
and records each rank's resident memory (RSS) after training and after each phase, glibc's heap, and each phase's
wall and CPU (user + system, all threads) seconds. Prints a table and writes
bench/results/<date>_<machine>_sample_<label>.json (results.write_result; `cpu2` on 2 cores without a GPU):
{"date", "machine", "command", ..., "runs": [{"name", "ranks": [{...}, ...]}]}.
Wall times depend on what else the machine runs: its load average is recorded before and after each run.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import time

from zoffbench.harness import report, run_function
from zoffbench.model_shapes import conf_model
from zoffbench.results import ROOT, write_result

GPT_125M = conf_model("gpt_125m")
PHASES = ("same_shape", "growing", "sample")


def rss_gb() -> float:
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kib / 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ["arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost"]]


def heap_gb() -> float | None:
    """Bytes in glibc's heaps, in use or free (blocks it maps one by one not included); None without glibc."""
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    return mallinfo2().arena / 2**30


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_worker(strategy_name: str, n_layer: int) -> None:
    """One run: train a step, then the phases in every rank; each rank reports its own."""
    import lightning.pytorch as pl
    import torch

    from lightning_zoff import ZoffStrategy
    from lightning_zoff.examples.corpus import SyntheticDataModule
    from lightning_zoff.examples.gpt import GPTModule

    class Phases(pl.Callback):
        def on_train_end(self, trainer, module):
            module.eval()
            memory = {"after_training": (rss_gb(), heap_gb())}
            times = {}

            def measure(phase, work):
                wall, cpu = time.perf_counter(), cpu_s()
                with torch.no_grad():
                    work()
                times[phase] = (time.perf_counter() - wall, cpu_s() - cpu)
                memory[phase] = (rss_gb(), heap_gb())

            idx = torch.randint(256, (1, 64))
            measure("same_shape", lambda: [module(idx) for _ in range(41)])
            measure("growing", lambda: [module(torch.randint(256, (1, n))) for n in range(1, 41)])
            torch.manual_seed(0)  # every rank the same draws
            measure("sample", lambda: module.sample(b"def ", 60, temperature=0.8, top_k=50))
            report({"rank": trainer.global_rank, "memory_gb": memory, "seconds": times}, rank=trainer.global_rank)

    torch.set_num_threads(1)  # one per rank on this 2-core box; and GNU OpenMP must not run before the fork
    pl.seed_everything(0)
    strategy = ZoffStrategy(start_method="fork") if strategy_name == "zoff" else "ddp_fork"
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="32-true", max_steps=1,
                         callbacks=[Phases()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    data = SyntheticDataModule(vocab_size=GPT_125M["vocab_size"], block_size=64, batch_size=2, num_samples=64)
    trainer.fit(GPTModule(**{**GPT_125M, "n_layer": n_layer}), datamodule=data)


def run(name: str, n_layer: int) -> dict:
    load_before = os.getloadavg()
    # this checkout's lightning_zoff, whichever is installed
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    ranks = run_function(run_worker, dict(strategy_name=name, n_layer=n_layer), env=env).check().results
    return {"name": name, "load_average_before": load_before, "load_average_after": os.getloadavg(),
            "ranks": list(ranks.values())}


def table(runs: list[dict]) -> str:
    """A row per rank: RSS after training and after each phase, glibc's heap at the end, each phase's wall (CPU) s."""
    header = ["run", "rank", "RSS GB: trained", *PHASES, "heap GB", *(f"{p} s (cpu)" for p in PHASES)]
    rows = [header]
    for r in runs:
        for rank in r["ranks"]:
            memory, seconds = rank["memory_gb"], rank["seconds"]
            heap = memory["sample"][1]
            rss = [f"{memory[k][0]:.2f}" for k in ("after_training", *PHASES)]
            times = [f"{seconds[p][0]:.1f} ({seconds[p][1]:.1f})" for p in PHASES]
            rows.append([r["name"], str(rank["rank"]), *rss, "-" if heap is None else f"{heap:.2f}", *times])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=["zoff", "ddp"], choices=["zoff", "ddp"])
    parser.add_argument("--label", default="", help="added to the output file's name (e.g. before, after)")
    parser.add_argument("--n-layer", type=int, default=GPT_125M["n_layer"], help="fewer blocks for a quick check")
    args = parser.parse_args()
    runs = [run(name, args.n_layer) for name in args.runs]
    allocator_env = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "THP_", "GLIBC_TUNABLES"))}
    record = {"label": args.label, "package": str(ROOT / "lightning_zoff"), "allocator_environment": allocator_env,
              "model": {**GPT_125M, "n_layer": args.n_layer}, "runs": runs}
    print(table(runs))
    print(f"wrote {write_result(record, 'sample' + (f'_{args.label}' if args.label else ''))}")

