"""scripts/bench/bench_host_time.py: the host's own time a step by who spends it, zoff and Lightning's strategy."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "bench_host_time.py"


@pytest.fixture(scope="module")
def host_time():
    spec = importlib.util.spec_from_file_location("bench_host_time", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("filename", "function", "who"), [
    ("/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py", "post_backward", "FSDP2"),
    ("/work/main/lightning_zoff/offload/updates.py", "finalize", "zoff"),
    ("/work/main/lightning_zoff/examples/gpt.py", "forward", "model"),
    ("/site-packages/lightning/pytorch/loops/fit_loop.py", "run", "Lightning"),
    ("/site-packages/torch/optim/adam.py", "_single_tensor_adam", "torch (Python)"),
    ("~", "<built-in method torch._C._nn.linear>", "torch (C++)"),
    ("~", "<method 'copy_' of 'torch._C.TensorBase' objects>", "torch (C++)"),
    ("~", "<built-in method builtins.getattr>", "Python built-ins"),
    ("/usr/lib/python3.11/contextlib.py", "__enter__", "other"),
])
def test_each_function_has_one_owner(host_time, filename, function, who):
    assert host_time.owner(filename, function) == who


def test_zoff_and_plain_runs_record_their_steps_and_where_the_host_time_went(host_time, tmp_path, monkeypatch):
    out = tmp_path / "host_time.json"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--blocks", "2", "--steps", "3", "--out", str(out)])
    host_time.main()
    zoff, plain = json.loads(out.read_text())["runs"]
    assert (zoff["run"], plain["run"]) == ("zoff", "plain")
    for run in (zoff, plain):
        assert len(run["step_ms"]) == 3  # the timed steps only: warm-up and profiled steps left out
        assert run["step_ms_median"] == sorted(run["step_ms"])[1]
        assert run["own_ms_by_owner"]["model"] > 0
        own = [f["own_ms"] for f in run["top_own"]]
        assert own == sorted(own, reverse=True)
    # zoff's rank ran in a process of its own: its profile came back, with FSDP2's hooks and zoff's engine in it
    assert zoff["own_ms_by_owner"]["FSDP2"] > 0
    assert zoff["own_ms_by_owner"]["zoff"] > 0
    assert "FSDP2" not in plain["own_ms_by_owner"]
    # none of zoff's engine in Lightning's own run: at most a log filter an earlier test left in this process (the main
    # job's `quiet()`), a microsecond
    assert plain["own_ms_by_owner"].get("zoff", 0.0) < 0.01 * sum(plain["own_ms_by_owner"].values())
