"""What the scripts share (zoffbench/: harness.py, recorders.py, model_shapes.py): the peak resident memory of a
process tree, a child's results by rank, the kill at a timeout, the failure line, the step recorder and the models by
name."""

from __future__ import annotations

import mmap
import os
import sys
import textwrap
import time

import psutil
import pytest

from zoffbench import harness, model_shapes

MB = 2**20
# a process that holds `MB_HELD` MiB (written, so resident) for a while, with a child of its own holding half that
TREE = textwrap.dedent("""
    import subprocess, sys, time
    held = int(sys.argv[1])
    child = subprocess.Popen([sys.executable, "-c", f"import time; x = b'1' * {held // 2} * 2**20; time.sleep(1.5)"])
    x = b"1" * held * 2**20
    time.sleep(1.5)
    child.wait()
""")
MB_HELD = 200


@pytest.mark.slow
def test_the_sampler_sums_the_whole_tree():
    run = harness.run_command([sys.executable, "-c", TREE, str(MB_HELD)], interval_s=0.05)
    assert run.ok
    assert run.peak_tree_rss > 1.5 * MB_HELD * MB  # both processes at once
    own = sorted(run.peak_rss_by_pid.values(), reverse=True)
    assert len(own) >= 2
    assert own[0] > MB_HELD * MB
    assert own[1] > MB_HELD / 2 * MB
    assert run.results == {}
    assert run.wall_s > 1.5


# a process that holds `MB_HELD` MiB and forks a child sharing them (copy on write), as a DataLoader worker does
FORKED = textwrap.dedent("""
    import os, sys, time
    held = bytearray(b"1") * (int(sys.argv[1]) * 2**20)  # one object, written: resident
    if os.fork() == 0:
        time.sleep(1.0)
        os._exit(0)
    time.sleep(1.0)
    os.wait()
""")


@pytest.mark.slow
def test_the_pss_of_a_forked_tree_counts_the_shared_pages_once():
    run = harness.run_command([sys.executable, "-c", FORKED, str(MB_HELD)], interval_s=0.05, pss_interval_s=0.1)
    assert run.ok
    assert run.peak_tree_rss > 1.8 * MB_HELD * MB  # each process's RSS counts the shared pages
    assert run.peak_tree_pss is not None
    assert MB_HELD * MB < run.peak_tree_pss < 1.3 * MB_HELD * MB  # the sum of PSS counts them once
    assert run.pss_read_s is not None
    assert 0 < run.pss_read_s < 1
    assert harness.run_command([sys.executable, "-c", "pass"]).peak_tree_pss is None  # not asked: not sampled


def test_the_sampler_of_this_process_sees_an_allocation_in_the_block():
    with harness.RssSampler(interval_s=0.005, tree=False) as rss:
        # pages of a mapping of its own, touched: resident now, whatever the C heap of this process (which has run
        # many tests) holds already. The block once saw no growth at all with `b"1" * (100 * MB)` and a 0.2 s sleep
        # (CI at b8bd2ff): either a malloc from pages resident before it, or a sampler thread not run in time
        held = mmap.mmap(-1, 100 * MB)
        for offset in range(0, 100 * MB, mmap.PAGESIZE):
            held[offset] = 1
        # the sampler's thread runs while this one sleeps: held until it has sampled a few times, at most 10 s
        samples_before = rss.samples
        deadline = time.monotonic() + 10
        while rss.samples < samples_before + 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        held.close()
    assert rss.peak - rss.before > 90 * MB
    assert rss.after < rss.peak
    assert rss.seconds > 0
    assert set(rss.peak_by_pid) == {os.getpid()}


@pytest.mark.slow
def test_a_timeout_kills_the_whole_tree(tmp_path):
    pid_file = tmp_path / "grandchild"
    sleeper = textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(p.pid))
        time.sleep(60)
    """)
    # long enough for two interpreters to start on 2 busy cores (at 4 s the grandchild was not always there yet)
    run = harness.run_command([sys.executable, "-c", sleeper], output="capture", timeout_s=10)
    assert run.timed_out
    assert not run.ok
    assert run.wall_s < 30
    assert run.failure() == "timed out after 10 s"
    assert harness.outcome_of(run.failure()) == "timeout"
    grandchild = int(pid_file.read_text())
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def measure(size: int, rank1: bool) -> dict:
    """Runs in the child: reports rank 1's result itself, returns rank 0's (with a tensor, which pickle carries)."""
    import torch

    if rank1:
        harness.report({"rank": 1, "values": [size] * 2}, rank=1)
    return {"rank": 0, "pid": os.getpid(), "tensor": torch.arange(size)}


def fails(message: str) -> None:
    raise ValueError(message)


@pytest.mark.slow
def test_results_come_back_by_rank():
    run = harness.run_function(measure, dict(size=3, rank1=True), output="capture")
    assert run.ok
    assert list(run.results) == [0, 1]
    assert run.results[0]["tensor"].tolist() == [0, 1, 2]
    assert run.results[0]["pid"] != os.getpid()
    assert run.results[1] == {"rank": 1, "values": [3, 3]}
    (only,) = harness.call(measure, size=2, rank1=False)
    assert only["tensor"].tolist() == [0, 1]


@pytest.mark.slow
def test_a_failed_child_names_its_cause():
    run = harness.run_function(fails, dict(message="no such model"), output="capture")
    assert not run.ok
    assert run.results == {}
    assert run.failure() == "ValueError: no such model"
    assert harness.outcome_of(run.failure()) == "error"
    with pytest.raises(harness.ChildFailed, match=r"(?s)exited with 1:.*ValueError: no such model"):
        harness.call(fails, message="no such model")


def started_with_port(hold_s: float) -> dict:
    start = time.time()
    time.sleep(hold_s)
    return {"port": os.environ["MASTER_PORT"], "start": start, "end": time.time()}


@pytest.mark.slow
def test_call_each_runs_its_children_at_once_each_with_its_own_port(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29999")  # what a forking launcher leaves in the parent: none may inherit it
    runs = harness.call_each(started_with_port, {name: dict(hold_s=2.0) for name in ("a", "b", "c")})
    assert list(runs) == ["a", "b", "c"]
    ends = [only["end"] for (only,) in runs.values()]
    assert all(only["start"] < min(ends) for (only,) in runs.values())  # each started before any ended
    ports = {only["port"] for (only,) in runs.values()}
    assert len(ports) == 3
    assert "29999" not in ports


def test_report_needs_a_parent():
    with pytest.raises(RuntimeError, match="ZOFF_HARNESS_RESULTS"):
        harness.report({})


def test_model_shapes_come_from_conf_model():
    assert model_shapes.model_shape("gpt1b") == dict(vocab_size=32000, block_size=1024, n_layer=24, n_head=16,
                                                     n_embd=2048, dropout=0.0, bias=False, tie_weights=False)
    assert model_shapes.model_shape("gpt7b")["block_size"] == 1024  # conf/model/gpt_7b.yaml has 2048
    assert model_shapes.model_shape("gpt7b")["n_embd"] == 4096
    assert model_shapes.model_shape("qwen3_4b") == {"hf": "qwen3_4b", "block_size": 512}
    assert model_shapes.model_shape("tiny")["n_layer"] == 2
    assert model_shapes.conf_model("gpt_125m")["tie_weights"] is True
    assert model_shapes.model_shape("llama3_8b") == {"hf": "llama3_8b", "block_size": 4096}
    assert model_shapes.model_shape("qwen3_14b") == {"hf": "qwen3_14b", "block_size": 4096}
    assert model_shapes.model_shape("qwen25_7b") == {"hf": "qwen25_7b", "block_size": 1024}
    assert set(model_shapes.MODEL_NAMES) == {"gpt1b", "gpt7b", "gpt13b", "gpt30b", "qwen3_4b", "llama3_8b", "qwen3_14b",
                                             "qwen25_7b",
                                             "qwen3_tiny", "tiny", "small"}


def test_options_are_python_literals_or_strings():
    assert harness.parse_options(["overlap=False", "cpu_threads=8", "accelerator_state=auto"]) == {
        "overlap": False, "cpu_threads": 8, "accelerator_state": "auto"}
    with pytest.raises(SystemExit, match="expected key=value"):
        harness.parse_options(["overlap"])


def test_the_step_recorder_records_every_batch(capsys):
    import lightning.pytorch as pl

    from helpers.tiny import token_loader
    from helpers.tiny_module import TinyModule
    from zoffbench.recorders import StepRecorder

    recorder = StepRecorder(verbose=True)
    module = TinyModule()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[recorder], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, token_loader(n=12, batch_size=4))
    assert recorder.losses == module.losses
    assert len(recorder.times) == 3
    assert all(t > 0 for t in recorder.times)
    assert capsys.readouterr().out.count("loss") == 3


def test_retries_per_step_are_the_differences_of_the_running_count():
    from zoffbench.recorders import retries_per_step

    # setup retried 3 times; the steps then 2, 0 and 5 times: a hand count
    assert retries_per_step([5, 5, 10], before_first=3) == [2, 0, 5]
    assert retries_per_step([]) is None


def test_a_retry_is_the_allocation_after_a_burst_of_released_segments():
    from zoffbench.alloc_history import retry_causes

    frames = [{"filename": "fsdp.py", "line": 7, "name": "all_gather"}]
    events = [
        {"action": "alloc", "size": 10, "stream": 0},
        {"action": "free_completed", "size": 10, "stream": 0},
        {"action": "segment_unmap", "size": 2 * 10**9, "stream": 5},
        {"action": "segment_unmap", "size": 10**9, "stream": 5},
        {"action": "segment_free", "size": 5 * 10**8, "stream": 0},
        {"action": "segment_map", "size": 4 * 10**9, "stream": 0},
        {"action": "alloc", "size": 4 * 10**9, "stream": 0, "frames": frames},
        {"action": "alloc", "size": 1, "stream": 0},
    ]
    (cause,) = retry_causes(events)
    assert cause == {"freed_gb_by_stream": {"5": 3.0, "0": 0.5}, "alloc_gb": 4.0, "alloc_stream": "0",
                     "alloc_frames": ["fsdp.py:7 all_gather"]}
    assert retry_causes(events[:2]) == []


def test_the_steps_peak_is_the_most_their_blocks_held_at_once():
    from zoffbench.alloc_history import peak_live

    def frames(name):
        return [{"filename": "/x/torch/_tensor.py", "line": 1, "name": "inner"},
                {"filename": "/env/site-packages/transformers/llama.py", "line": 9, "name": name}]

    events = [
        {"action": "free_completed", "addr": 7, "size": 100, "stream": 0},  # made before recording: not counted
        {"action": "alloc", "addr": 1, "size": 3 * 10**9, "stream": 0, "frames": frames("mlp")},
        {"action": "alloc", "addr": 2, "size": 10**9, "stream": 9, "frames": frames("gather")},
        {"action": "free_requested", "addr": 2, "size": 10**9, "stream": 9},  # still held until completed
        {"action": "alloc", "addr": 3, "size": 2 * 10**9, "stream": 0, "frames": frames("mlp")},
        {"action": "free_completed", "addr": 2, "size": 10**9, "stream": 9},
        {"action": "free_completed", "addr": 1, "size": 3 * 10**9, "stream": 0},
        {"action": "alloc", "addr": 4, "size": 10**9, "stream": 0, "frames": []},
    ]
    peak = peak_live(events)
    assert peak == {"live_gb": 6.0, "awaiting_streams_gb": 1.0, "by_stream_gb": {"0": 5.0, "9": 1.0},
                    "top_sites_gb": {"transformers/llama.py:9 mlp": 5.0, "transformers/llama.py:9 gather": 1.0}}
