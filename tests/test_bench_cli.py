"""scripts/bench/bench.py without a GPU: the plot from made-up runs, DeepSpeed's configurations as dicts, the ratio
search against made-up outcomes, the failure lines, and one tiny CPU run through the whole command line."""

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zoffbench import bench, deepspeed_runs, harness, model_shapes, plot, results, runs

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
REPO = SCRIPTS.parent

ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def fake_run(name, step, forward, backward, exposed, **extra):
    run = dict(name=name, model="gpt7b", accumulate=1, batch=4, gpu_memory_gb=None, exact=True, step_s_median=step,
               forward_s=forward, backward_s=backward, exposed_optimizer_s=exposed, peak_gpu_gb=30.0, host_gb=90.0)
    return {**run, **extra}


FAKE_RUNS = [
    fake_run("gpu_only", 0.5, 0.15, 0.3, 0.02),
    fake_run("zoff", 1.9, 0.2, 0.4, 1.2, host_tree_peak_gb=110.0),
    fake_run("deepspeed_zero3_offload_ratio", 4.2, 0.3, 0.9, 2.8, ratio=0.5),
    fake_run("deepspeed_zero2_zenflow", 1.1, 0.2, 0.5, 0.6, exact=False),
    dict(name="deepspeed_zero2_offload", model="gpt7b", accumulate=1, batch=4, gpu_memory_gb=None, exact=True,
         error="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", outcome="gpu_oom"),
]


def test_step_segments_leave_the_rest_as_other():
    segments = plot.step_segments(FAKE_RUNS[1])
    assert segments == pytest.approx({"forward": 0.2, "backward": 0.4, "exposed optimizer": 1.2, "other": 0.1})
    # zoff's exposed time also counts forwards that waited: the phases may sum past the step, "other" stays 0
    assert plot.step_segments(fake_run("zoff", 1.0, 0.4, 0.5, 0.3))["other"] == 0.0


def test_labels_name_ratio_and_inexact_runs():
    assert plot.run_label(FAKE_RUNS[2]) == "deepspeed_zero3_offload_ratio acc 1 ratio 0.5"
    assert plot.run_label(FAKE_RUNS[3]).endswith("(inexact)")
    assert plot.run_label(FAKE_RUNS[0], with_model=True).startswith("gpt7b gpu_only")
    assert plot.host_gb(FAKE_RUNS[1]) == 110.0
    assert plot.host_gb(FAKE_RUNS[0]) == 90.0


def test_plot_draws_every_run_failed_ones_included(tmp_path):
    # matplotlib comes with the dev extra (through examples): a missing one fails here rather than skipping
    capped = [{**run, "gpu_memory_gb": 24} for run in FAKE_RUNS]
    path = plot.plot_runs(capped, tmp_path / "bench.png", title="python scripts/bench/bench.py --model gpt7b")
    assert path == tmp_path / "bench.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_prints_a_note(tmp_path, monkeypatch, capsys):
    for module in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib... raises ImportError
    assert plot.plot_runs(FAKE_RUNS, tmp_path / "bench.png") is None
    assert "matplotlib is missing" in capsys.readouterr().out
    assert not (tmp_path / "bench.png").exists()


def test_deepspeed_configurations():
    assert deepspeed_runs.config_overrides("deepspeed_zero3_offload", ADAMW) == {}
    assert deepspeed_runs.config_overrides("deepspeed_zero2_offload", ADAMW) == {}
    ratio = deepspeed_runs.config_overrides("deepspeed_zero3_offload_ratio", ADAMW, ratio=0.3)
    assert ratio == {"zero_optimization": {"sub_group_size": 100_000_000, "offload_optimizer": {"ratio": 0.3}}}
    with pytest.raises(ValueError, match="needs a ratio"):
        deepspeed_runs.config_overrides("deepspeed_zero3_offload_ratio", ADAMW)
    zenflow = deepspeed_runs.config_overrides("deepspeed_zero2_zenflow", ADAMW)
    assert zenflow["zero_optimization"]["zenflow"]["topk_ratio"] == 0.05
    assert zenflow["optimizer"] == {"type": "AdamW",
                                    "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
    json.dumps(zenflow)  # DeepSpeed gets plain JSON values
    assert deepspeed_runs.unsupported("deepspeed_zero2_zenflow", 4)
    assert deepspeed_runs.unsupported("deepspeed_zero2_zenflow", 1) is None
    assert {"deepspeed_zero2_zenflow"} == deepspeed_runs.INEXACT


def test_merge_keeps_lightnings_keys():
    # Lightning's default for stage 3 with offload_optimizer=True, pin_memory=True (abridged)
    lightning = {"zero_allow_untested_optimizer": True,
                 "zero_optimization": {"stage": 3, "sub_group_size": 1e12, "overlap_comm": True,
                                       "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4}}}
    overrides = deepspeed_runs.config_overrides("deepspeed_zero3_offload_ratio", ADAMW, ratio=0.4)
    merged = deepspeed_runs.merge(lightning, overrides)
    assert merged["zero_optimization"] == {"stage": 3, "sub_group_size": 100_000_000, "overlap_comm": True,
                                           "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                                 "buffer_count": 4, "ratio": 0.4}}
    assert merged["zero_allow_untested_optimizer"] is True


@pytest.mark.parametrize(("fits_from", "host_fails_from", "expected"), [
    (0.1, None, 0.1), (0.4, None, 0.4), (1.0, None, 1.0), (0.7, 0.9, 0.7), (0.8, 0.8, None), (None, None, None)])
def test_ratio_search_finds_the_smallest_that_fits(fits_from, host_fails_from, expected):
    def outcome(ratio):
        if host_fails_from is not None and ratio >= host_fails_from:
            return "host_oom"
        return "fits" if fits_from is not None and ratio >= fits_from else "gpu_oom"

    best, tries = bench.smallest_fitting_ratio(list(deepspeed_runs.RATIOS), outcome)
    assert best == expected
    assert len(tries) <= 5
    assert len(tries) == 1 or tries[0] == (0.1, "gpu_oom")
    assert all(outcome(ratio) == result for ratio, result in tries)


def test_ratio_search_stops_at_another_failure():
    best, tries = bench.smallest_fitting_ratio([0.1, 0.2, 0.3], lambda ratio: "error")
    assert best is None
    assert tries == [(0.1, "error")]
    best, tries = bench.smallest_fitting_ratio([0.1, 0.2, 0.3, 0.4], lambda r: "gpu_oom" if r < 0.2 else "error")
    assert best is None
    assert tries == [(0.1, "gpu_oom"), (0.3, "error")]


def test_failure_lines():
    traceback = "\n".join([
        "Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139 GiB",
        "During handling of the above exception, another exception occurred:",
        "RuntimeError: NCCL communicator was aborted"])
    line = harness.failure_line(traceback, 1)
    assert line.startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert harness.outcome_of(line) == "gpu_oom"
    line = harness.failure_line("warning: slow\nAssertionError: Hybrid Optimizer Only Supports DeepSpeedCPUAdam\n", 1)
    assert line == "AssertionError: Hybrid Optimizer Only Supports DeepSpeedCPUAdam"
    assert harness.outcome_of(line) == "error"
    line = harness.failure_line("loading\n", -9)
    assert line.startswith("killed by SIGKILL")
    assert harness.outcome_of(line) == "host_oom"
    line = harness.failure_line("RuntimeError: [enforce fail] DefaultCPUAllocator: can't allocate", 1)
    assert harness.outcome_of(line) == "host_oom"
    refused = "\n".join([  # the plan's refusal in rank 0, then torch's warning at the exit (the H100 run of 2026-12-06)
        "[rank0]: lightning_zoff.placement.refusal.PlanDoesNotFit: zoff: the optimizer state of 14,768,307,200 ...",
        "[rank0]:[W1206 10:35:41.222621654 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() ..."])
    line = harness.failure_line(refused, 1)
    assert line.startswith("[rank0]: lightning_zoff.placement.refusal.PlanDoesNotFit: zoff: the optimizer state")
    assert harness.outcome_of(line) == "refused"
    worker_killed = "\n".join([  # the kernel killed a DataLoader worker; the training process failed after it
        "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed. ",
        "The above exception was the direct cause of the following exception:",
        "RuntimeError: DataLoader worker (pid(s) 4242) exited unexpectedly"])
    line = harness.failure_line(worker_killed, 1)
    assert line.startswith("RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed")
    assert harness.outcome_of(line) == "host_oom"
    assert harness.failure_line("", 3) == "exit code 3, nothing on stderr"


def test_exactness():
    assert runs.inexact_because("zoff", {}) is None
    assert runs.inexact_because("zoff_bf16_moments", {}) == "moments stored in bf16"
    assert runs.inexact_because("zoff", {"optimizer_state_dtype": "bf16"}) == "moments stored in bf16"
    assert runs.inexact_because("deepspeed_zero2_zenflow", {})
    assert all(runs.inexact_because(name, {}) is None for name in ("gpu_only", "fsdp2_cpu_offload",
               "deepspeed_zero3_offload", "deepspeed_zero2_offload", "deepspeed_zero3_offload_ratio"))


def test_compare_against_the_fastest_exact_deepspeed():
    entries = [dict(name="deepspeed_zero3_offload", accumulate=1, exact=True, tokens_per_s=100.0),
                  dict(name="deepspeed_zero3_offload_ratio", accumulate=1, exact=True, tokens_per_s=200.0),
               dict(name="deepspeed_zero2_zenflow", accumulate=1, exact=False, tokens_per_s=1000.0),
               dict(name="deepspeed_zero2_offload", accumulate=1, exact=True, error="CUDA out of memory"),
               dict(name="zoff", accumulate=1, exact=True, tokens_per_s=400.0)]
    bench.compare(entries)
    assert entries[-1]["vs_best_exact_deepspeed"] == 2.0
    assert entries[-1]["best_exact_deepspeed"] == "deepspeed_zero3_offload_ratio"
    assert entries[-1]["vs_gpu_only"] is None


def test_models_and_default_runs():
    assert model_shapes.model_shape("gpt13b") == dict(vocab_size=32000, block_size=1024, n_layer=40, n_head=40,
                                                 n_embd=5120, dropout=0.0, bias=False, tie_weights=False)
    assert {"fsdp2_cpu_offload", "gpu_only", "zoff", *deepspeed_runs.DEEPSPEED_RUNS} <= set(runs.DEFAULT_RUNS)
    assert runs.model_spec("gpt13b", layers=20)["n_layer"] == 20
    with pytest.raises(SystemExit, match="qwen3_4b is a Hugging Face preset"):
        runs.model_spec("qwen3_4b", layers=20)


@pytest.mark.slow
def test_cpu_run_records_model_and_gpu_memory(tmp_path):
    """The whole command line on the CPU (about 15 s once the kernels are built): the entry carries the model and the
    cap (which a CPU run records and cannot apply), and the PNG lands next to the JSON."""
    out = tmp_path / "bench.json"
    command = [sys.executable, str(SCRIPTS / "bench" / "bench.py"), "--model", "tiny", "--runs", "zoff", "--accumulate",
               "1", "--steps", "2", "--warmup", "1", "--batch", "2", "--gpu-memory-gb", "24", "--num-workers", "2",
               "--out", str(out)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    record = json.loads(out.read_text())
    assert list(record)[:3] == ["date", "machine", "command"]  # write_result's header, then the bench's own keys
    assert record["machine"] == results.machine()
    assert record["command"] == shlex.join(["python", "scripts/bench/bench.py", *command[2:]])
    (run,) = record["runs"]
    assert run["model"] == "tiny"
    assert run["gpu_memory_gb"] == 24
    assert record["gpu_memory_gb"] == 24
    assert run["exact"] is True
    assert run["batch"] == 2
    assert (run["seq"], run["num_workers"]) == (64, 2)
    # forked loader workers share their parent's pages: the tree's PSS counts them once, its RSS in every process
    assert 0.1 < run["host_tree_peak_pss_gb"] < run["host_tree_peak_gb"]
    assert run["pss_read_s"] > 0
    assert run["plan_host_gb"] == pytest.approx(run["memory"]["host_total"] / 1e9)
    assert run["tree_pss_within_plan_capacity"] is True
    assert run["recomputed_blocks"] == 0  # a CPU holds any step: "auto" recomputes nothing
    assert run["forward_s"] > 0
    # of the step's time outside its phases, the gaps between them (the loop's own work), logged and printed
    between = run["telemetry_median"]["zoff/between_s"]
    assert between > 0
    assert f"(between phases {between:.3f}s)" in done.stdout
    # zoff's own lines of the run, as its node logged them: where the state went at setup among them
    assert any(line.startswith("zoff rank 0: state: ") for line in run["zoff_lines"]), run["zoff_lines"]
    assert run["backward_s"] > 0
    assert run["step_s_median"] > 0
    assert run["host_tree_peak_gb"] > 0.1  # the child's tree, sampled while it ran: Python, torch and Lightning
    assert run["wall_s"] > 0
    assert 0 < run["setup_s"] < run["wall_s"]  # from the child's start to its first step
    assert 0 <= run["exit_s"] < run["wall_s"]  # from its measurement to its end
    floor = run["host_floor"]  # every unit on the host: the update's bytes per second against the machine's copy
    assert floor["host_params"] == run["params"]
    assert floor["host_copy_gb_s"] > 0
    assert floor["host_update_gb_s"] > 0
    assert floor["host_update_of_copy"] == pytest.approx(floor["host_update_gb_s"] / floor["host_copy_gb_s"])
    schema = {f.name for f in dataclasses.fields(harness.BenchRun) if f.name != "ratio"}
    schema |= {f.name for f in dataclasses.fields(harness.StepMeasurement)} - {"inexact_because", "deepspeed_config"}
    assert schema <= set(run)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_unsupported_run_is_an_entry_without_a_process():
    args = argparse.Namespace(model="gpt1b", batch=8, gpu_memory_gb=None, zoff_option=[], layers=None,
                              activation_checkpointing=False, clip=1.0, clip_asked=False, seq=None, num_workers=0,
                              data="random")
    entry = bench.run_child(args, "deepspeed_zero2_zenflow", accumulate=4, steps=8, warmup=2)
    assert entry["outcome"] == "unsupported"
    assert "accumulate 1" in entry["error"]
    assert entry["model"] == "gpt1b"
    assert entry["gpu_memory_gb"] is None
    assert entry["exact"] is False
    assert entry["gradient_clip_val"] == 1.0


def test_the_users_models_run_at_seq_4096_with_loader_workers():
    assert {"llama3_8b", "qwen3_14b"} <= set(bench.MODEL_NAMES)
    assert set(bench.LOADER_WORKERS) == {"llama3_8b", "qwen3_14b", "qwen25_7b"}  # the last: MegaTrain's
    assert {"zoff", "zoff_bf16_moments", "deepspeed_zero3_offload"} <= set(bench.RUNS)
    entry = runs.bench_run("deepspeed_zero3_offload", "llama3_8b", 1, 1, [], None, None, False,
                                 num_workers=4).entry()
    assert (entry["seq"], entry["num_workers"], entry["batch"], entry["layers"]) == (4096, 4, 1, None)
    assert deepspeed_runs.unsupported("deepspeed_zero3_offload", 1) is None
    assert runs.bench_run("zoff", "gpt1b", 1, 8, [], None, None, False, seq=256).entry()["seq"] == 256


def test_the_bench_data_comes_from_loader_workers():
    import torch

    from zoffbench.data import RandomTokens

    data = RandomTokens(vocab_size=50, seq=8, batch=2, length=6, num_workers=2)
    loader = data.train_dataloader()
    assert (loader.num_workers, loader.persistent_workers) == (2, True)
    batches = list(loader)
    assert len(batches) == 3
    for x, y in batches:
        assert x.shape == y.shape == (2, 8)
        assert int(x.max()) < 50
        assert torch.equal(x[:, 1:], y[:, :-1])  # y: the next tokens
    in_process = list(RandomTokens(vocab_size=50, seq=8, batch=2, length=6).train_dataloader())
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, in_process, strict=True))  # same tokens


def test_the_plan_beside_the_tree():
    memory = {"host_total": 80e9, "host_capacity": 110e9, "host_kept": 20e9}
    assert bench.plan_against_tree(memory, 1, int(95e9)) == {
        "plan_host_gb": 80.0, "plan_host_capacity_gb": 110.0, "plan_host_available_gb": 130.0,
        "tree_pss_beyond_plan_gb": pytest.approx(15.0), "tree_pss_within_plan_capacity": True,
        "tree_pss_within_plan": True}
    # past what zoff may hold, within what the host had: the rest of the tree used what the plan kept for it
    beyond = bench.plan_against_tree(memory, 2, int(230e9))
    assert beyond["tree_pss_within_plan_capacity"] is False
    assert beyond["tree_pss_within_plan"] is True
    assert bench.plan_against_tree(memory, 2, int(270e9))["tree_pss_within_plan"] is False
    assert bench.plan_against_tree(None, 1, int(95e9)) == {}  # not zoff: no plan
    assert set(bench.plan_against_tree(memory, 1, None)) == {"plan_host_gb", "plan_host_capacity_gb",
                                                             "plan_host_available_gb"}


def test_the_runs_are_a_table_of_specs():
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_zoff import ZoffStrategy
    from lightning_zoff.examples.gpt import Block, GPTModule

    before_the_table = ("gpu_only", *deepspeed_runs.DEEPSPEED_RUNS, "fsdp2_cpu_offload", *runs.ZOFF_VARIANTS,
                        "zoff_no_offload", "zoff_fabric")  # the names and order --runs offered as an if-chain
    peers = {"fsdp_cpu_offload", "torchao_cpu_offload"}  # added since, for issue 53 (tests/test_bench_peers.py)
    assert before_the_table == tuple(name for name in runs.RUNS if name not in peers)
    assert peers < set(runs.RUNS)
    build, strategy, precision = runs.build_run("gpu_only", "tiny", {})
    assert (strategy, precision) == ("auto", "bf16-mixed")
    module = build(None)
    assert type(module) is GPTModule
    assert module.hparams["lr"] == ADAMW["lr"]
    build, strategy, precision = runs.build_run("fsdp2_cpu_offload", "tiny", {})
    assert isinstance(strategy, ModelParallelStrategy)
    assert precision == "32-true"  # FSDP2's MixedPrecisionPolicy casts
    module = build(None)
    assert isinstance(module, GPTModule)
    assert type(module).configure_model is runs.ShardedByFSDP2WithCPUOffload.configure_model
    # a variant's options, then --zoff-option's, then the blocks recomputed with --activation-checkpointing
    _, strategy, precision = runs.build_run("zoff_sync", "tiny", {"cpu_threads": 1}, checkpointing=True)
    assert isinstance(strategy, ZoffStrategy)
    assert precision == "bf16-mixed"
    config = strategy.config
    assert (config.overlap, config.accelerator_state, config.cpu_threads, config.offload) == (False, "none", 1, True)
    assert config.activation_checkpointing_policy == {Block}
    assert runs.build_run("zoff_no_offload", "tiny", {})[1].config.offload is False
    assert runs.family_of("gpt1b", seq=256)[1]["block_size"] == 256  # a GPT's position table follows


@pytest.fixture
def fresh_machine():
    results.machine.cache_clear()  # machine() is read once per process; these tests change what it reads
    yield
    results.machine.cache_clear()


@pytest.fixture
def two_h200s(tmp_path, monkeypatch, fresh_machine):
    """An nvidia-smi on PATH that lists two H200s."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\nprintf 'NVIDIA H200\\nNVIDIA H200\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_a_result_is_named_by_date_machine_and_what(two_h200s, monkeypatch, tmp_path):
    today = datetime.date.today()
    assert results.visible_gpus() == ["NVIDIA H200", "NVIDIA H200"]
    assert results.result_path("kernels") == results.RESULTS / f"{today}_h200x2_kernels.json"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # as gpu_checks.sh's bench_1of2 stage runs
    results.machine.cache_clear()
    assert results.machine()["gpus"] == 1
    assert results.result_path("bench_gpt1b").name == f"{today}_h200x1_bench_gpt1b.json"
    assert results.machine_tag(["NVIDIA A100-SXM4-80GB"] * 8, 64) == "a100x8"
    assert results.machine_tag([], 2) == "cpu2"  # bench/results/2026-12-01_cpu2_sample_after.json


def test_write_result_puts_the_header_first(two_h200s, monkeypatch, tmp_path):
    monkeypatch.setattr(results, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / "bench" / "bench_kernels.py"), "--params", "1e6"])
    path = results.write_result({"rows": [{"name": "ours"}], "machine_note": "kept"}, "kernels")
    assert path == tmp_path / "results" / f"{datetime.date.today()}_h200x2_kernels.json"
    record = json.loads(path.read_text())
    assert list(record) == ["date", "machine", "command", "rows", "machine_note"]
    assert record["date"] == datetime.date.today().isoformat()
    assert record["command"] == "python scripts/bench/bench_kernels.py --params 1e6"
    machine = record["machine"]
    assert (machine["tag"], machine["gpu"], machine["gpus"]) == ("h200x2", "NVIDIA H200", 2)
    assert machine["cores"] == len(os.sched_getaffinity(0))
    assert machine["torch"].split("+")[0] == __import__("torch").__version__.split("+")[0]
    assert results.describe(machine).startswith("NVIDIA H200 x2, ")
    assert results.describe("an older record's line") == "an older record's line"
    out = tmp_path / "given.json"
    assert results.write_result({"rows": []}, "kernels", out) == out  # --out wins over the rule
    assert json.loads(out.read_text())["rows"] == []


def test_clipped_fraction_counts_as_zoff_clips():
    # zoff clips when norm + 1e-6 > max_norm (torch's clip_grad_norm_ coefficient below 1)
    assert harness.clipped_fraction([0.5, 1.0, 2.0, 0.999], 1.0) == 0.5
    assert harness.clipped_fraction([0.5, 2.0], None) is None  # no clipping asked
    assert harness.clipped_fraction([], 1.0) is None  # no zoff telemetry (DeepSpeed, GPU-only)



def test_measured_steps_after_a_placement_pause_are_named():
    # MegaTrain's configuration on 1x H100 (session 26, staging ring 0): the first step placed the state for 1.47 s,
    # and the step after it, measured, was 16.09 s against 17.01 and 17.05 after (its exposed update 0.35 s, 1.35 after)
    record = json.loads((REPO / "bench/results/2026-12-07_h100x1_session26_megatrain_ring_0.json").read_text())
    run = record["runs"][0]
    telemetry = [dict(zip(run["telemetry_steps"], values, strict=True))
                 for values in zip(*run["telemetry_steps"].values(), strict=True)]
    assert harness.after_placement_pause(telemetry, warmup=1) == [1]
    assert harness.after_placement_pause(telemetry, warmup=2) == []  # what gpu_checks.sh's MegaTrain stages measure
    assert harness.after_placement_pause([{"zoff/placement_s": 0.1}, {}, {"zoff/placement_s": 0.3}, {}], 0) == [3]
    assert harness.after_placement_pause([{}, {}], 1) == []  # no zoff telemetry (DeepSpeed, GPU-only)
    note = bench.paused({**run, "after_placement_pause": [1]})
    assert "step(s) [1] follow a placement pause" in note
    assert "16.092s" in note
    assert bench.paused(run) == ""  # the file predates the field

def test_text_data_is_the_main_jobs_corpus_in_shuffled_windows():
    from zoffbench.data import TextTokens

    data = TextTokens(seq=64, batch=4)
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == y.shape == (4, 64)
    assert torch.equal(x[:, 1:], y[:, :-1])  # next tokens
    assert int(x.max()) < 128  # the standard library's source: ASCII bytes
    assert b"def " in bytes(data.corpus.train_set.tokens[:100_000].tolist())


@pytest.mark.slow
def test_a_text_run_records_its_norms_and_clipped_fraction(tmp_path):
    out = tmp_path / "bench.json"
    # bench.py's parent here (the test above runs its whole command line); the run in a fresh process of its own
    bench.main(["--model", "tiny", "--runs", "zoff", "--accumulate", "1", "--steps", "4", "--warmup", "1", "--batch",
                "4", "--data", "text", "--clip", "2.0", "--out", str(out)])
    run = json.loads(out.read_text())["runs"][0]
    assert run["data"] == "text"
    norms = run["grad_norms"]
    assert len(norms) == 5  # warm-up included
    assert run["clipped_fraction"] == sum(n + 1e-6 > 2.0 for n in norms[1:]) / 4
    steps = run["telemetry_steps"]  # each step's telemetry, where the medians hide how it moved
    assert steps["zoff/grad_norm"] == norms
    assert len(steps["zoff/cpu_update_s"]) == 5
    assert all(seconds > 0 for seconds in steps["zoff/cpu_update_s"])
