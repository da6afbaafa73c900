"""Memory and time of no-grad forwards and of sampling after a training step: zoff next to DDP, 2 CPU ranks.

    python scripts/bench/bench_sample.py                             # gpt_125m's shape, zoff and ddp
    python scripts/bench/bench_sample.py --runs zoff --label before  # one run, named in the output file

What it measures and writes: zoffbench/sample_bench.py.
"""

from zoffbench.sample_bench import main

if __name__ == "__main__":
    main()
