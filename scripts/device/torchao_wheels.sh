#!/usr/bin/env bash
# Add to ./.whl (in .gitignore) torchao's wheel for the GPU machine (Python 3.12, torch 2.11, no network), next to
# those of ../shared/tools/device_wheels.sh and scripts/device/hf_wheels.sh, for bench.py's run torchao_cpu_offload.
# torchao 0.18.0 needs torch >= 2.11 (its release notes) and nothing else at run time; it imports under this box's
# torch 2.13 too. Its one wheel is cp310-abi3: CPUOffloadOptimizer is Python, and a compiled kernel that does not load
# (the cp310 one under Python 3.12) is a warning at import, not an error.
# Usage (from the project root):  scripts/device/torchao_wheels.sh
# In each device run: carry [".whl"]; scripts/device/gpu_checks.sh installs every wheel there into /tmp/site.
set -euo pipefail
dest=.whl
mkdir -p "$dest"
py=${PYTHON:-python3}
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$dest" torchao==0.18.0
ls -1 "$dest" | grep torchao
