"""Run a command and report the peak resident memory of its whole process tree (the parent and its ranks).

    python scripts/peak_rss.py --out rss.json -- python scripts/train.py model=hf_qwen3_4b data=synthetic

Samples every 0.5 s with psutil; prints the peak of the sum over the tree and of each process, and the exit code.
Exits with the command's code.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    started = time.perf_counter()
    child = subprocess.Popen(command)
    root = psutil.Process(child.pid)
    peak_total, peak_by_pid = 0, {}
    while child.poll() is None:
        total = 0
        for proc in [root, *root.children(recursive=True)]:
            try:
                rss = proc.memory_info().rss
            except psutil.Error:
                continue
            total += rss
            peak_by_pid[proc.pid] = max(peak_by_pid.get(proc.pid, 0), rss)
        peak_total = max(peak_total, total)
        time.sleep(0.5)
    result = {"command": command, "returncode": child.returncode, "wall_s": time.perf_counter() - started,
              "peak_tree_rss_gb": peak_total / 1e9,
              "peak_rss_gb_by_process": sorted((rss / 1e9 for rss in peak_by_pid.values()), reverse=True)[:8]}
    print(f"peak_rss: tree {result['peak_tree_rss_gb']:.1f} GB, largest processes"
          f" {[round(x, 1) for x in result['peak_rss_gb_by_process']]} GB, exit {child.returncode},"
          f" {result['wall_s']:.0f} s", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    sys.exit(child.returncode)


if __name__ == "__main__":
    main()
