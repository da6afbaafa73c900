#!/usr/bin/env bash
# Add to ./.whl (in .gitignore) the wheels Hugging Face transformers needs on the GPU machine (Python 3.12, no network),
# next to those of ../shared/tools/device_wheels.sh, for lightning_zoff.examples.hf and tests/test_hf.py.
# The GPU image already has torch, lightning (and what they need: filelock, fsspec, packaging, PyYAML,
# typing-extensions), numpy, tqdm, ninja, pybind11, pytest, psutil.
# Usage (from the project root):  scripts/device/hf_wheels.sh
# In each device run: carry [".whl"] and start the command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
dest=.whl
mkdir -p "$dest"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
py=${PYTHON:-python3}
# transformers and its hub client, tokenizers, safetensors (the versions tests/test_hf.py ran with)
$py -m pip download -q --no-deps "${plat[@]}" -d "$dest" transformers==5.24.0 huggingface-hub==2.4.0 \
    tokenizers==0.23.3 safetensors==0.8.0 'regex>=2025.10.22' hf-xet==1.8.0
# the hub client's HTTP stack and transformers' CLI (typer, rich)
$py -m pip download -q --no-deps "${plat[@]}" -d "$dest" httpx2==2.16.2 httpcore2==2.16.2 'anyio>=4' idna h11 \
    truststore 'click>=8.4.2,<9' typer==0.29.2 shellingham rich markdown-it-py mdurl pygments annotated-doc
# LitGPT (scripts/train_litgpt.py, scripts/bench/bench_litgpt_scripts.py), without its pins (as .ci/run installs it)
$py -m pip download -q --no-deps "${plat[@]}" -d "$dest" litgpt==0.5.13
# typer's pydantic: the same names as device_wheels.sh --with-deepspeed, so both scripts fetch the same files
$py -m pip download -q --no-deps "${plat[@]}" -d "$dest" pydantic pydantic-core annotated-types \
    typing-inspection 'typing-extensions>=4.16'
ls -1 "$dest"
