"""How long a user waits for zoff to refuse a run it cannot do, against the imports alone.

Runs `tests/scripts/refused.py MISTAKE` (a 2-rank Trainer fit with Lightning's default launcher, refused before any
rank starts) `--repeat` times per mistake, and a child that only imports lightning.pytorch and lightning_zoff. Prints
the median wall-clock and CPU seconds (the child's own and its children's, user and system) and writes them as JSON
(results.write_result: `--out`, or bench/results/<date>_<machine>_refusal.json).
The refusal test (tests/test_errors.py) asserts what happens before a refusal; this script measures how long it takes.

    python scripts/bench/bench_refusal.py [--repeat 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zoffbench.results import ROOT, write_result

REFUSED = ROOT / "tests" / "scripts" / "refused.py"
MISTAKES = ("manual", "sgd", "two", "missing", "foreign")
IMPORTS = "import lightning.pytorch, lightning_zoff"


def timed(command: list[str], cwd: str) -> tuple[float, float, int]:
    """Wall-clock and CPU seconds of one command, and its exit code."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env={**os.environ, "TMPDIR": cwd})
    wall, after = time.monotonic() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu, proc.returncode


def command_for(mistake: str, work: str) -> list[str]:
    if mistake == "imports":
        return [sys.executable, "-c", IMPORTS]
    args = []
    if mistake in ("missing", "foreign"):
        ckpt = Path(work) / ("notes.txt" if mistake == "foreign" else "missing.ckpt")
        if mistake == "foreign":
            ckpt.write_text("not a checkpoint")
        args = [str(ckpt)]
    return [sys.executable, str(REFUSED), mistake, *args]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for mistake in ("imports", *MISTAKES):
        walls, cpus = [], []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="zoff-refusal-") as work:
                wall, cpu, code = timed(command_for(mistake, work), work)
            expected = 0 if mistake == "imports" else 1
            if code != expected:
                raise SystemExit(f"{mistake}: exit code {code}, expected {expected}")
            walls.append(wall)
            cpus.append(cpu)
        rows.append({"run": mistake, "wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
                     "wall_all_s": walls, "cpu_all_s": cpus})
    print(f"{'run':<10} {'wall s':>8} {'CPU s':>8}")
    for row in rows:
        print(f"{row['run']:<10} {row['wall_s']:>8.2f} {row['cpu_s']:>8.2f}")
    print(f"wrote {write_result({'repeat': args.repeat, 'runs': rows}, 'refusal', args.out)}")


if __name__ == "__main__":
    main()
