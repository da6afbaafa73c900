"""Where the CUDA allocator's retries come from (issue 46 item 3): with `ZOFF_BENCH_ALLOC_HISTORY=1` a zoff run
records the allocator's events (torch's memory history, Python frames) over its last `LAST_STEPS` steps, and its JSON
gets `gpu_alloc_retry_causes`: for each retry, the allocation that asked (its bytes, stream and frames) and what the
retry freed, per stream. A retry is a cudaMalloc that failed: the allocator then frees every cached block it can
(its events `segment_free` / `segment_unmap`, in a burst) and tries again. A block freed on one stream is cached for
that stream alone, so the streams' cached remainders add up: the freed bytes per stream say whose cache stood in the
way. Beside them, `gpu_step_peak` (`peak_live`): the most bytes the recorded steps' own blocks held at once, per
stream and by the frame that made them, to set against the plan's traced step, and how many of those bytes their
tensors had freed already (the allocator reuses them once other streams' work on them is done).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import torch

LAST_STEPS = 3
FRAMES = 12  # of each asking allocation, innermost first
RELEASES = ("segment_free", "segment_unmap")


def wanted() -> bool:
    return os.environ.get("ZOFF_BENCH_ALLOC_HISTORY") == "1" and torch.cuda.is_available()


def start() -> None:
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")


def stop_and_read() -> list[dict[str, Any]]:
    """The events recorded since `start` on the current device, oldest first; recording stops."""
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    traces = snapshot.get("device_traces", [])
    device = torch.cuda.current_device()
    return list(traces[device]) if device < len(traces) else []


def retry_causes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each burst of released segments and the allocation that follows it (the one that failed and was retried)."""
    causes = []
    i = 0
    while i < len(events):
        if events[i].get("action") not in RELEASES:
            i += 1
            continue
        freed: dict[str, int] = defaultdict(int)
        while i < len(events) and events[i].get("action") in RELEASES:
            freed[str(events[i].get("stream", "?"))] += int(events[i].get("size", 0))
            i += 1
        asking = next((e for e in events[i:] if e.get("action") == "alloc"), None)
        causes.append({
            "freed_gb_by_stream": {stream: nbytes / 1e9 for stream, nbytes in freed.items()},
            "alloc_gb": None if asking is None else int(asking.get("size", 0)) / 1e9,
            "alloc_stream": None if asking is None else str(asking.get("stream", "?")),
            "alloc_frames": [] if asking is None else [
                f"{frame.get('filename', '?')}:{frame.get('line', '?')} {frame.get('name', '?')}"
                for frame in asking.get("frames", [])[:FRAMES]],
        })
    return causes


# the frames that say who made a block: the first of these, innermost first, names its site
SITE_MARKERS = ("transformers/", "lightning_zoff/", "torch/distributed/", "torch/utils/checkpoint", "zoffbench/",
                "torch/nn/")
SITES = 20


def peak_live(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The most bytes that blocks allocated while recording held at once (what the steps themselves allocate: the
    model and the state were allocated before), per stream, and the largest sites then, by the frame that made them:
    the step's peak as the GPU held it, to set against the plan's traced step."""
    live: dict[int, dict[str, Any]] = {}
    total = peak = peak_at = 0
    for index, event in enumerate(events):
        action, addr = event.get("action"), int(event.get("addr", 0))
        if action == "alloc":
            live[addr] = event
            total += int(event.get("size", 0))
            if total > peak:
                peak, peak_at = total, index
        elif action == "free_completed" and addr in live:
            total -= int(live.pop(addr).get("size", 0))
    live, released = {}, set()
    for event in events[: peak_at + 1]:  # the blocks alive at the peak, replayed
        addr = int(event.get("addr", 0))
        if event.get("action") == "alloc":
            live[addr] = event
            released.discard(addr)
        elif event.get("action") == "free_requested":
            released.add(addr)
        elif event.get("action") == "free_completed":
            live.pop(addr, None)
            released.discard(addr)
    # freed by their tensors but not yet reusable: another stream's work on them was pending (`record_stream`)
    awaiting = sum(int(live[addr].get("size", 0)) for addr in released if addr in live)
    by_stream: dict[str, int] = defaultdict(int)
    by_site: dict[str, int] = defaultdict(int)
    for event in live.values():
        size = int(event.get("size", 0))
        by_stream[str(event.get("stream", "?"))] += size
        by_site[_site(event.get("frames", []))] += size
    top = sorted(by_site.items(), key=lambda item: -item[1])[:SITES]
    return {"live_gb": peak / 1e9, "awaiting_streams_gb": awaiting / 1e9,
            "by_stream_gb": {s: n / 1e9 for s, n in by_stream.items()},
            "top_sites_gb": {site: n / 1e9 for site, n in top}}


def _site(frames: list[dict[str, Any]]) -> str:
    for frame in frames:
        filename = str(frame.get("filename", ""))
        if any(marker in filename for marker in SITE_MARKERS):
            return f"{filename.split('site-packages/')[-1]}:{frame.get('line', '?')} {frame.get('name', '?')}"
    return "?"
