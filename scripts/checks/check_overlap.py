"""The overlapped engine against the synchronous one on this machine's accelerator: same bits, or it fails.

    python scripts/checks/check_overlap.py --steps 20 --out overlap_check.json

The check itself: zoffbench/checks/overlap.py.
"""

from zoffbench.checks.overlap import main

if __name__ == "__main__":
    main()
