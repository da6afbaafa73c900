"""The GPU acceptance checks: `python -m pytest tests/gpu` on the GPU machine is the acceptance run.

Each test runs the training jobs of one check (zoffbench/checks/, behind scripts/checks/check_*.py) in fresh
processes (zoffbench/harness.py) and asserts on its summary. Without CUDA every test here is skipped at collection,
so CI's `pytest tests` passes over them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
            # first, so that without CUDA this is the reason given rather than a test's own (two GPUs, a large host)
            item.add_marker(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: an acceptance"
                                               " check for the GPU machine"), append=False)


def pytest_runtest_logreport(report):
    # each test's time as it ends, where the acceptance stage asks (`$ZOFF_TEST_TIMES`): a run cut by the call's limit
    # prints no durations at its end
    times = os.environ.get("ZOFF_TEST_TIMES")
    if times and report.when == "call":
        with open(times, "a") as file:
            file.write(f"{report.duration:8.1f} s {report.outcome:>7} {report.nodeid}\n")


@pytest.fixture(autouse=True)
def threads_as_in_a_users_run(monkeypatch):
    # tests/conftest.py gives the CPU tests one torch thread per process; the runs started here get Lightning's
    # default, as scripts/device/gpu_checks.sh's do (test_check_reference's fp32 CPU side would take ~10x longer on
    # one thread)
    if os.environ.get("OMP_NUM_THREADS") == "1":
        monkeypatch.delenv("OMP_NUM_THREADS")
