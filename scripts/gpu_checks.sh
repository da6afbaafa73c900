#!/usr/bin/env bash
# One device-machine session: environment, the CPU suite on that torch, the reference check and the benchmark.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash scripts/gpu_checks.sh
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
{ nvidia-smi -L; nproc; free -g | head -2; python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"; ulimit -l; } 2>&1 | tee "$OUT/env.txt"
timeout 100 python3 -m pytest -q -x tests/test_training.py 2>&1 | tail -15 | tee "$OUT/pytest.txt"
timeout 150 python3 scripts/check_reference.py --steps 30 --out "$OUT/reference_check.json" 2>&1 | grep -v "^INFO\|Tip\|available:" | tee "$OUT/reference_check.txt"
timeout 320 python3 scripts/bench.py --runs gpu_only zoff --accumulate 1 4 --steps 6 --warmup 2 --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
