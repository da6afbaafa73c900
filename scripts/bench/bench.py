"""Side-by-side step time of offloaded and GPU-only training, one subprocess per run, one harness for all.

    python scripts/bench/bench.py                          # GPT 1.34B (d=2048, 24 layers, seq 1024, batch 8) on 1 GPU
    python scripts/bench/bench.py --model small --runs zoff gpu_only --accumulate 1
    python scripts/bench/bench.py --model gpt7b --batch 4 --accumulate 1 --runs zoff gpu_only
    python scripts/bench/bench.py --model gpt13b --batch 4 --accumulate 1 --runs zoff deepspeed_zero3_offload_ratio
    python scripts/bench/bench.py --model gpt7b --batch 1 --accumulate 1 --gpu-memory-gb 24   # as on a 24 GB GPU
    python scripts/bench/bench.py --model qwen3_4b --runs zoff deepspeed_zero3_offload --accumulate 1 \
        --zoff-option overlap=False
    python scripts/bench/bench.py --model llama3_8b --batch 1 --runs zoff deepspeed_zero3_offload --accumulate 1
    python scripts/bench/bench.py --model qwen3_tiny --runs zoff --accumulate 1 --steps 2 --warmup 1   # CPU smoke test
    python scripts/bench/bench.py --plot bench/results/2026-12-02_h200x1_gpt13b_b4_zoff.json   # draw a JSON's PNG again

What it measures and writes (the JSON's keys): zoffbench/bench.py.
"""

from zoffbench.bench import main

if __name__ == "__main__":
    main()
