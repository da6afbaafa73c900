"""Peak host memory of `python -m lightning_zoff.consolidate` against the size of the model it writes.

    python scripts/bench/bench_consolidate.py [--width 4096] [--blocks 16] [--ranks 1] [--buffer-mb 256] [--dir DIR]

What it measures and writes: zoffbench/consolidate_bench.py.
"""

from zoffbench.consolidate_bench import main

if __name__ == "__main__":
    main()
