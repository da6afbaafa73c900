"""Optimizer state kept on the GPU against all of it on the host, on this machine's accelerator.

    python scripts/checks/check_placement.py --steps 12 --out placement_check.json

The check itself: zoffbench/checks/placement.py.
"""

from zoffbench.checks.placement import main

if __name__ == "__main__":
    main()
