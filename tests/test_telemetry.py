"""The step's breakdown by phase (`lightning_zoff/telemetry.py`), off CUDA: wall-clock seconds from a clock the test
drives, so every phase and every gap between phases is known exactly."""

from __future__ import annotations

import pytest
import torch

from lightning_zoff import telemetry
from lightning_zoff.telemetry import StepTimer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(telemetry.time, "perf_counter", clock)
    return clock


def run_phase(timer: StepTimer, clock: Clock, phase: str, seconds: float, then_idle: float) -> None:
    with timer.measure(phase):
        clock.now += seconds
    clock.now += then_idle


def test_a_window_sums_its_phases_and_the_gaps_between_them(clock):
    timer = StepTimer(torch.device("cpu"))
    clock.now += 7.0  # before the first phase: no phase ended yet, so no gap
    for _ in range(2):  # two micro-batches, each backward followed by 0.03 s outside every phase, then the step
        run_phase(timer, clock, "forward", 0.25, then_idle=0.0)
        run_phase(timer, clock, "backward", 0.5, then_idle=0.03)
    run_phase(timer, clock, "exposed_optimizer", 0.1, then_idle=0.2)
    first = timer.end_window(gate_wait=0.0)
    assert first == pytest.approx({"forward": 0.5, "first_forward": 0.25, "backward": 1.0, "exposed_optimizer": 0.1,
                                   "between": 0.06, "gate_wait": 0.0})
    run_phase(timer, clock, "forward", 0.25, then_idle=0.0)  # the step's 0.2 s of tail opens the next window
    run_phase(timer, clock, "backward", 0.5, then_idle=0.0)
    run_phase(timer, clock, "exposed_optimizer", 0.1, then_idle=0.0)
    second = timer.end_window(gate_wait=0.0)
    assert second is not None
    assert second["between"] == pytest.approx(0.2)


def test_the_logged_breakdown_has_the_gaps_and_moves_the_gate_wait(clock):
    timer = StepTimer(torch.device("cpu"))
    run_phase(timer, clock, "forward", 0.4, then_idle=0.05)
    run_phase(timer, clock, "backward", 0.5, then_idle=0.0)
    run_phase(timer, clock, "forward", 0.2, then_idle=0.0)
    run_phase(timer, clock, "backward", 0.5, then_idle=0.0)
    times = timer.end_window(gate_wait=0.1)

    class Traffic:
        cpu_update_s, d2h_bytes, h2d_bytes = 0.3, 2e9, 1e9
        speculations_kept = speculations_redone = lent_units = lent_elements = 0
        landing_wait_s = 0.25

    metrics = telemetry.step_metrics(times, Traffic(), grad_norm=1.0, skipped=False, loss_scale=1.0)
    assert metrics["zoff/between_s"] == pytest.approx(0.05)
    assert metrics["zoff/forward_s"] == pytest.approx(0.5)  # the forward's wait for an update is the optimizer's
    assert metrics["zoff/first_forward_s"] == pytest.approx(0.3)  # the wait is the first forward's
    assert metrics["zoff/exposed_optimizer_s"] == pytest.approx(0.1)
    assert metrics["zoff/backward_s"] == pytest.approx(1.0)
    assert metrics["zoff/landing_wait_s"] == 0.25  # backward's waits for landing room, as the engine counted them
