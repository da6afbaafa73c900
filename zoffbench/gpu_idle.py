"""Where the GPU sits idle in a step (issue 53: MegaTrain's configuration spends 0.6 s a step "between" phases, issue
48: LitGPT's full.py 48 ms an iteration more under zoff, neither explained). With `ZOFF_BENCH_PROFILE=1` a zoff run
profiles its last optimizer step (torch.profiler, host and CUDA activity; for diagnosis: the profiled step is slower,
so take timings from a run without it), and its JSON gets `gpu_idle`: the step's span on the GPU, the time in it no
kernel, copy or fill ran on the GPU, and the longest idle gaps, each with the host calls that covered it (innermost
first: the wait or the work the GPU waited for) and those that started in it; and the idle time summed by the
innermost host call covering each gap (`idle_by_host_call`); and the GPU's busy time summed by kernel (`busy_by_kernel`,
the longest first: what the GPU did, set beside another run's, as zoff's gpt1b at batch 1 beside GPU-only's).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

GAPS = 12  # the longest idle gaps reported
LEAST_S = 1e-4  # shorter gaps count in the idle total, not in the list or the sums by host call
CALLS = 3  # host calls named per gap, of each kind
KERNELS = 15  # the kernels (by name) with the most GPU time reported
NAME_CHARS = 90  # a kernel's name is cut there: C++ templates make names of thousands of characters
# what the GPU runs, by the profiler's activity type; its GPU-side user annotations ("Optimizer.step#AdamW.step",
# "FSDP::pre_forward") span the kernels launched under them and the idle time between, so they are not work
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class HostCall:
    name: str
    start: float  # seconds
    end: float
    thread: int


def wanted() -> bool:
    return os.environ.get("ZOFF_BENCH_PROFILE") == "1" and torch.cuda.is_available()


def start() -> torch.profiler.profile | None:
    """A profiler of host and CUDA activity, started; None where it cannot start (said on stderr)."""
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])
    try:
        profiler.start()
    except Exception as error:  # a diagnosis never ends the run it diagnoses
        print(f"ZOFF_BENCH_PROFILE: the profiler did not start: {type(error).__name__}: {error}", file=sys.stderr)
        return None
    return profiler


def stop_and_read(profiler: torch.profiler.profile) -> dict[str, Any] | None:
    """Stop `profiler` and read what it saw: `idle_gaps` of its device activity and host calls (None without any
    device activity; `{"error": ...}` where reading failed: a diagnosis never ends the run it diagnoses)."""
    try:
        return _read(profiler)
    except Exception as error:  # reported in the JSON instead
        return {"error": f"{type(error).__name__}: {error}"}


def _read(profiler: torch.profiler.profile) -> dict[str, Any] | None:
    profiler.stop()
    results = profiler.profiler.kineto_results if profiler.profiler is not None else None
    events = results.events() if results is not None else []
    busy, host, kernels = [], [], []
    for event in events:
        start, end = event.start_ns() / 1e9, event.end_ns() / 1e9
        if event.device_type() == torch.autograd.DeviceType.CUDA:
            if event.activity_type() in DEVICE_WORK:
                busy.append((start, end))
                kernels.append((event.name(), end - start))
        elif end > start:
            host.append(HostCall(event.name(), start, end, int(event.start_thread_id())))
    return {**idle_gaps(busy, host), "busy_by_kernel": busy_by_kernel(kernels)} if busy else None


def busy_by_kernel(kernels: list[tuple[str, float]]) -> list[dict[str, Any]]:
    """The GPU time of `kernels` (name, seconds) summed by name (cut to `NAME_CHARS`), the `KERNELS` longest, each with
    how many ran; on several streams at once their sum may exceed the step."""
    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for name, duration in kernels:
        seconds[name[:NAME_CHARS]] += duration
        count[name[:NAME_CHARS]] += 1
    longest = heapq.nlargest(KERNELS, seconds, key=seconds.__getitem__)
    return [{"name": name, "s": seconds[name], "count": count[name]} for name in longest]


def idle_gaps(busy: list[tuple[float, float]], host: list[HostCall]) -> dict[str, Any]:
    """The idle time within the span of `busy` intervals (seconds, on any of the device's streams) and its longest
    gaps, each with the host calls covering it (innermost first) and those that started in it (longest first)."""
    merged: list[list[float]] = []
    for start, end in sorted(busy):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    gaps = [(a[1], b[0]) for a, b in itertools.pairwise(merged) if b[0] > a[1]]
    calls = sorted(host, key=lambda c: c.start)
    starts = [c.start for c in calls]
    by_call: dict[str, float] = defaultdict(float)
    described: list[dict[str, Any]] = []
    active: list[HostCall] = []  # calls started by the gap's start, not yet ended: a sweep, gaps in time order
    taken = 0
    for start, end in gaps:
        while taken < len(calls) and calls[taken].start <= start:
            active.append(calls[taken])
            taken += 1
        active = [c for c in active if c.end >= start]
        if end - start < LEAST_S:
            continue
        covering = sorted((c for c in active if c.end >= end), key=lambda c: c.end - c.start)
        started = heapq.nlargest(CALLS, calls[bisect.bisect_right(starts, start):bisect.bisect_left(starts, end)],
                                 key=lambda c: c.end - c.start)
        by_call[covering[0].name if covering else "(no host call)"] += end - start
        described.append({"at_s": start - merged[0][0], "s": end - start,
                          "covered_by": [_named(c) for c in covering[:CALLS]],
                          "started_in": [_named(c) for c in started]})
    described.sort(key=lambda g: -g["s"])
    return {"span_s": merged[-1][1] - merged[0][0], "idle_s": sum(end - start for start, end in gaps),
            "gaps": len(gaps), "longest": described[:GAPS],
            "idle_by_host_call": dict(sorted(by_call.items(), key=lambda item: -item[1]))}


def _named(call: HostCall) -> str:
    return f"{call.name} ({(call.end - call.start) * 1e3:.2f} ms, thread {call.thread})"


def summary(result: dict[str, Any]) -> list[str]:
    """Lines for each run of a bench JSON `result` that has `gpu_idle`: its idle share, the host calls the idle time
    sat under, and the longest gaps."""
    lines = []
    for run in result.get("runs", []):
        idle = run.get("gpu_idle")
        if not idle:
            continue
        if "error" in idle:
            lines.append(f"{run['name']}: the profile could not be read: {idle['error']}")
            continue
        lines.append(f"{run['name']} acc={run.get('accumulate')}: GPU idle {idle['idle_s'] * 1e3:.1f} ms of a"
                     f" {idle['span_s'] * 1e3:.1f} ms step ({idle['gaps']} gaps)")
        lines += [f"  under {name}: {seconds * 1e3:.1f} ms" for name, seconds in
                  list(idle["idle_by_host_call"].items())[:6]]
        lines += [f"  gap {gap['s'] * 1e3:.2f} ms at {gap['at_s'] * 1e3:.1f} ms: covered by {gap['covered_by'][:2]},"
                  f" started in it {gap['started_in'][:2]}" for gap in idle["longest"][:5]]
        lines += [f"  busy {kernel['s'] * 1e3:.1f} ms in {kernel['count']} x {kernel['name']}"
                  for kernel in idle.get("busy_by_kernel", [])[:8]]
    return lines


if __name__ == "__main__":  # python -m zoffbench.gpu_idle RESULT.json ...: the summary of each
    import json
    from pathlib import Path

    for path in sys.argv[1:]:
        print(path, *summary(json.loads(Path(path).read_text())), sep="\n")
