"""The main job's loss with `update_lag=1` beside the exact run's: `scripts/train.py` twice with the same seed and
data, then each run's training loss (rank 0's, from the LossHistory its last checkpoint keeps) and validation loss at
the last step. Prints a table, writes JSON and one plot of both curves.

    python scripts/checks/check_update_lag.py [--steps 200] [--out bench/results/FILE.json] [key=value ...]

Extra `key=value` arguments go to both runs (for example `trainer=gpu`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 20  # the training loss at the end: the mean of the last WINDOW steps (one batch's loss is noisy)


def run(steps: int, lag: int, work: Path, overrides: list[str]) -> dict:
    """One main job; its loss history."""
    run_dir = work / f"lag{lag}"
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), f"trainer.max_steps={steps}",
               f"strategy.update_lag={lag}", f"hydra.run.dir={run_dir}", "sample.max_new_tokens=0", *overrides]
    subprocess.run(command, check=True, cwd=work)
    meta = torch.load(run_dir / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=False)
    history = meta["callbacks"]["LossHistory"]
    return {"train": history["train"], "val": history["val"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="zoff-lag-") as work:
        runs = {lag: run(args.steps, lag, Path(work), overrides) for lag in (0, 1)}
    rows = {}
    for lag, history in runs.items():
        last = [loss for step, loss in history["train"] if step > args.steps - WINDOW]
        rows[lag] = {"train_loss_end": statistics.fmean(last), "val_loss_end": history["val"][-1][1]}
    exact, lagged = rows[0], rows[1]
    difference = {key: lagged[key] / exact[key] - 1 for key in exact}
    print(f"{'update_lag':>10} {'train (last ' + str(WINDOW) + ')':>18} {'val':>8}")
    for lag, row in rows.items():
        print(f"{lag:>10} {row['train_loss_end']:>18.4f} {row['val_loss_end']:>8.4f}")
    print("lag against exact: " + ", ".join(f"{k} {v:+.2%}" for k, v in difference.items()))
    if args.out:
        args.out.write_text(json.dumps({"steps": args.steps, "overrides": overrides, "end": rows,
                                        "relative_difference": difference, "runs": runs}, indent=1) + "\n")
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        for lag, history in runs.items():
            steps, losses = zip(*history["train"], strict=True)
            ax.plot(steps, losses, linewidth=0.8, label=f"train, update_lag={lag}")
            ax.plot(*zip(*history["val"], strict=True), "o-", label=f"val, update_lag={lag}")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.savefig(args.out.with_suffix(".png"), dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
