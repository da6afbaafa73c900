"""The bench's reading of the CUDA allocator's recorded events (`zoffbench/alloc_history.py`), on events written by
hand in the snapshot's format: a retry is a burst of released segments before the allocation that asked, and the
steps' peak is the most bytes their own blocks held at once, by stream and by the frame that made them."""

from zoffbench import alloc_history

MB = 2**20


def alloc(addr, size, stream=0, filename="site-packages/transformers/models/llama/modeling_llama.py", line=1):
    return {"action": "alloc", "addr": addr, "size": size, "stream": stream,
            "frames": [{"filename": "torch/_tensor.py", "line": 9, "name": "inner"},
                       {"filename": filename, "line": line, "name": "forward"}]}


def freed(addr, size, stream=0):
    return {"action": "free_completed", "addr": addr, "size": size, "stream": stream}


def released(size, stream):
    return {"action": "segment_free", "addr": 0, "size": size, "stream": stream}


def test_a_retry_is_the_released_burst_and_the_allocation_after_it():
    events = [alloc(1, 10 * MB), released(4 * MB, 7), {"action": "segment_unmap", "size": 2 * MB, "stream": 7},
              released(6 * MB, 0), alloc(2, 30 * MB, stream=0, line=42), released(MB, 0)]
    causes = alloc_history.retry_causes(events)
    assert len(causes) == 2
    first = causes[0]
    assert first["freed_gb_by_stream"] == {"7": 6 * MB / 1e9, "0": 6 * MB / 1e9}
    assert first["alloc_gb"] == 30 * MB / 1e9
    assert first["alloc_stream"] == "0"
    assert first["alloc_frames"][1].endswith("modeling_llama.py:42 forward")
    assert causes[1]["alloc_gb"] is None
    assert causes[1]["alloc_frames"] == []


def test_the_peak_counts_the_blocks_alive_together_by_stream_and_site():
    lightning_zoff = "site-packages/lightning_zoff/offload/landing.py"
    events = [alloc(1, 10 * MB), alloc(2, 20 * MB, stream=5, filename=lightning_zoff, line=3),
              freed(1, 10 * MB),  # 30 MB at once so far
              alloc(3, 15 * MB), alloc(4, 5 * MB),  # 40 MB: the peak
              freed(3, 15 * MB), freed(4, 5 * MB), alloc(5, 35 * MB),  # 55 MB
              freed(5, 35 * MB), freed(2, 20 * MB), freed(99, 500 * MB)]  # a block from before recording: ignored
    peak = alloc_history.peak_live(events)
    assert peak["live_gb"] == 55 * MB / 1e9
    assert peak["awaiting_streams_gb"] == 0
    assert peak["by_stream_gb"] == {"5": 20 * MB / 1e9, "0": 35 * MB / 1e9}
    assert peak["top_sites_gb"] == {
        "transformers/models/llama/modeling_llama.py:1 forward": 35 * MB / 1e9,
        "lightning_zoff/offload/landing.py:3 forward": 20 * MB / 1e9,
    }


def requested(addr, size, stream=0):
    return {"action": "free_requested", "addr": addr, "size": size, "stream": stream}


def test_the_peak_says_which_of_its_blocks_were_freed_but_wait_for_another_stream():
    events = [alloc(1, 10 * MB, stream=5), requested(1, 10 * MB, stream=5),  # its copy on another stream still runs
              alloc(2, 10 * MB, stream=5), requested(2, 10 * MB, stream=5), freed(2, 10 * MB, stream=5),
              alloc(3, 30 * MB),  # the peak: 1 and 3 held
              freed(1, 10 * MB, stream=5), freed(3, 30 * MB)]
    peak = alloc_history.peak_live(events)
    assert peak["live_gb"] == 40 * MB / 1e9
    assert peak["awaiting_streams_gb"] == 10 * MB / 1e9
