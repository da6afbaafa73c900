"""Run a command and report the peak resident memory of its whole process tree (the parent and its ranks).

    python scripts/bench/peak_rss.py --out rss.json -- python scripts/train.py model=hf_qwen3_4b data=synthetic

Samples every 0.5 s (harness.RssSampler); prints the peak of the sum over the tree and of each process, and the exit
code. Exits with the command's code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from zoffbench.harness import run_command


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    run = run_command(command)
    result = {"command": command, "returncode": run.returncode, "wall_s": run.wall_s,
              "peak_tree_rss_gb": run.peak_tree_rss / 1e9,
              "peak_rss_gb_by_process": sorted((rss / 1e9 for rss in run.peak_rss_by_pid.values()), reverse=True)[:8]}
    print(f"peak_rss: tree {result['peak_tree_rss_gb']:.1f} GB, largest processes"
          f" {[round(x, 1) for x in result['peak_rss_gb_by_process']]} GB, exit {run.returncode},"
          f" {result['wall_s']:.0f} s", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    sys.exit(run.returncode)


if __name__ == "__main__":
    main()
