"""Where the CUDA allocator's retries come from (issue 46 item 3): with `ZOFF_BENCH_ALLOC_HISTORY=1` a zoff run
records the allocator's events (torch's memory history, Python frames) over its last `LAST_STEPS` steps, and its JSON
gets `gpu_alloc_retry_causes`: for each retry, the allocation that asked (its bytes, stream and frames) and what the
retry freed, per stream. A retry is a cudaMalloc that failed: the allocator then frees every cached block it can
(its events `segment_free` / `segment_unmap`, in a burst) and tries again. A block freed on one stream is cached for
that stream alone, so the streams' cached remainders add up: the freed bytes per stream say whose cache stood in the
way.
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
