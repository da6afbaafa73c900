"""Where the host's time goes in a step too small for the device to matter: a GPT of many tiny blocks on CPU, under
zoff with every unit's state "on the accelerator" (the CPU stands in: the path the GPU's units take), the same with
each unit kept gathered from its forward to its backward (`reshard_after_forward=False`), and under Lightning's
single-device strategy, one after the other.

On the GPU, a 1B model at batch 1 waits for the host's launches (1x H100, 2026-12-07: gpt1b 0.61-0.71x GPU-only,
the GPU busy less than half the step), so the host's time per step is what to cut; this measures it without a GPU.
Each run's median step (unprofiled steps), then as many steps under cProfile: the host's own time by who spends it
(FSDP2's hooks, zoff, Lightning, torch's Python, torch's C++ ops, the model) and the functions that spend the most.
Prints a table and writes JSON (results.write_result: `--out`, or bench/results/<date>_<machine>_host_time.json).

    python scripts/bench/bench_host_time.py [--blocks 24] [--steps 20] [--runs zoff zoff_kept plain] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zoff import ZoffStrategy
from lightning_zoff.examples.gpt import GPTModule
from zoffbench.results import write_result

SEQ, VOCAB, WIDTH = 16, 256, 32
WARMUP = 5
TOP = 15  # functions listed by their own time
OWNERS = (  # the first whose marker is in a function's file names its owner
    ("torch/distributed/fsdp", "FSDP2"), ("lightning_zoff/examples", "model"), ("lightning_zoff/", "zoff"),
    ("lightning/", "Lightning"), ("torch/", "torch (Python)"))


def owner(filename: str, function: str) -> str:
    """Who spends a function's own time: by its file, or for a built-in by what it is."""
    if filename == "~":  # a built-in: torch's C++ ops and tensor methods, or Python's own
        return "torch (C++)" if "torch" in function else "Python built-ins"
    return next((name for marker, name in OWNERS if marker in filename.replace("\\", "/")), "other")


def breakdown(profile: cProfile.Profile, steps: int) -> dict[str, Any]:
    """Own time per step by owner, and the `TOP` functions with the most own time (per step)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    by_owner: dict[str, float] = {}
    functions = []
    for (filename, line, function), (_, calls, own, _, _) in stats.items():
        who = owner(filename, function)
        by_owner[who] = by_owner.get(who, 0.0) + own / steps
        functions.append({"function": f"{Path(filename).name}:{line}({function})", "owner": who,
                          "own_ms": own / steps * 1e3, "calls": calls / steps})
    functions.sort(key=lambda f: -f["own_ms"])
    return {"own_ms_by_owner": {k: v * 1e3 for k, v in sorted(by_owner.items(), key=lambda kv: -kv[1])},
            "top_own": functions[:TOP]}


class HostTimes(pl.Callback):
    """Times `steps` steps after `WARMUP`, profiles the next `steps`, and writes both to `out` (the rank runs in a
    process of its own under zoff)."""

    def __init__(self, steps: int, out: Path) -> None:
        self.steps, self.out = steps, out
        self.times: list[float] = []
        self.profile = cProfile.Profile()
        self.started = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == WARMUP + self.steps:
            self.profile.enable()
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if WARMUP <= trainer.global_step - 1 < WARMUP + self.steps:  # global_step counts the step just made
            self.times.append(time.perf_counter() - self.started)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profile.disable()
        self.out.write_text(json.dumps({"step_ms_median": statistics.median(self.times) * 1e3,
                                        "step_ms": [t * 1e3 for t in self.times],
                                        **breakdown(self.profile, self.steps)}))


# zoff_kept: each unit stays gathered from its forward to its backward (reshard_after_forward=False)
STRATEGIES = {"zoff": dict(accelerator_state=1.0),
              "zoff_kept": dict(accelerator_state=1.0, reshard_after_forward=False)}


def run(name: str, blocks: int, steps: int) -> dict[str, Any]:
    strategy: Any = ZoffStrategy(start_method="fork", **STRATEGIES[name]) if name in STRATEGIES else "auto"
    pl.seed_everything(0)
    tokens = torch.randint(0, VOCAB, (4 * (WARMUP + 2 * steps), SEQ + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1)
    module = GPTModule(vocab_size=VOCAB, block_size=SEQ, n_layer=blocks, n_head=2, n_embd=WIDTH)
    with tempfile.TemporaryDirectory(prefix="zoff-host-time-") as work:
        out = Path(work) / "times.json"
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="32-true",
                             max_steps=WARMUP + 2 * steps, gradient_clip_val=1.0, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[HostTimes(steps, out)], default_root_dir=work)
        trainer.fit(module, data)
        return {"run": name, "blocks": blocks, **json.loads(out.read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--steps", type=int, default=20, help="timed steps, then as many profiled")
    parser.add_argument("--runs", nargs="+", choices=(*STRATEGIES, "plain"), default=["zoff", "plain"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the host's Python, not its cores, is measured
    rows = [run(name, args.blocks, args.steps) for name in args.runs]
    owners = list(dict.fromkeys(k for row in rows for k in row["own_ms_by_owner"]))
    print(f"{'run':<6} {'step ms':>8}  own ms a profiled step: " + "  ".join(owners))
    for row in rows:
        print(f"{row['run']:<6} {row['step_ms_median']:>8.1f}  "
              + "  ".join(f"{row['own_ms_by_owner'].get(k, 0.0):.1f}" for k in owners))
    for row in rows:
        print(f"{row['run']}: most own time", *(f"  {f['own_ms']:6.2f} ms {f['calls']:7.0f} calls {f['owner']:<14}"
                                                f" {f['function']}" for f in row["top_own"][:8]), sep="\n")
    print(f"wrote {write_result({'blocks': args.blocks, 'steps': args.steps, 'runs': rows}, 'host_time', args.out)}")


if __name__ == "__main__":
    main()
