"""What every benchmark writes: its record as JSON under one header (the date, the machine, the command line) in a file
named by one rule, `bench/results/<date>_<machine>_<what>.json` (bench/README.md collects them), for example
`2026-12-03_h200x1_bench_gpt13b.json` or `2026-12-01_cpu2_sample_after.json`.

The machine is read without torch (nvidia-smi for the GPUs, torch's installed version from its metadata), so a parent
that measures its children stays small, as in harness.py.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def visible_gpus() -> list[str]:
    """The names of the GPUs this process may use (nvidia-smi's, as many as CUDA_VISIBLE_DEVICES lets through)."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, check=False)
    names = [line.strip() for line in query.stdout.splitlines() if line.strip()] if query.returncode == 0 else []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        names = names[:len([device for device in visible.split(",") if device.strip()])]
    return names


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    return name or platform.processor() or platform.machine()


def torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def machine() -> dict[str, Any]:
    """This machine: its short name (`tag`, as in the results' file names), GPUs, CPU, host memory and torch."""
    gpus = visible_gpus()
    cores = len(os.sched_getaffinity(0))
    return {"tag": machine_tag(gpus, cores), "gpu": gpus[0] if gpus else None, "gpus": len(gpus), "cpu": cpu_model(),
            "cores": cores, "host_memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
            "torch": torch_version(), "python": platform.python_version(), "host": socket.gethostname()}


def machine_tag(gpus: list[str], cores: int) -> str:
    """"h200x1" for one NVIDIA H200 (the first word of the GPU's name with a digit in it, and the count), "cpu2" for
    2 cores and no GPU."""
    if not gpus:
        return f"cpu{cores}"
    words = re.split(r"[\s-]+", gpus[0])
    model = next((word for word in words if any(c.isdigit() for c in word)), words[-1])
    return f"{re.sub(r'[^a-z0-9]', '', model.lower())}x{len(gpus)}"


def describe(header: dict[str, Any] | str) -> str:
    """A record's machine in one line (older records hold a line already)."""
    if isinstance(header, str):
        return header
    gpu = f"{header['gpu']} x{header['gpus']}, " if header.get("gpus") else ""
    return (f"{gpu}{header['cpu']} ({header['cores']} cores), {header['host_memory_gb']:.0f} GB host,"
            f" torch {header['torch']}, host {header['host']}")


def command_line() -> str:
    """This process's command as a user types it from the repository's root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])


def result_path(what: str) -> Path:
    """The one rule: bench/results/<date>_<machine>_<what>.json."""
    return RESULTS / f"{datetime.date.today()}_{machine()['tag']}_{what}.json"


def write_result(record: dict[str, Any], what: str, out: Path | None = None) -> Path:
    """Write `record` after the header {"date", "machine", "command"} to `out`, by default `result_path(what)`; the
    path written. A benchmark that writes as it goes passes the same `out` each time."""
    path = out or result_path(what)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"date": datetime.date.today().isoformat(), "machine": machine(), "command": command_line()}
    path.write_text(json.dumps({**header, **record}, indent=1) + "\n")
    return path
