"""zoff on N devices against zoff on 1 device with the same global batch: losses, per-rank memory, thread layout.

    python scripts/checks/check_scaling.py --devices 2 --steps 20 --out scaling_check.json

The check itself: zoffbench/checks/scaling.py.
"""

from zoffbench.checks.scaling import main

if __name__ == "__main__":
    main()
