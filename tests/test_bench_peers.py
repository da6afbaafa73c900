"""scripts/bench/bench.py's peers at their own headline configurations (issue 53) without a GPU: the
megatrain_qwen25_7b preset and its model, FSDP2's CPU offload built where it needs the model, Lightning's FSDP, blocks
recomputed in every run, and torchao's CPUOffloadOptimizer refused here with its reason."""

import functools
import importlib.util
import json
import sys
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from zoffbench import bench, configs, model_shapes, runs, torchao_run

MEGATRAIN = dict(model="qwen25_7b", batch=8, accumulate=[18], seq=1024, num_workers=4, activation_checkpointing=True,
                 zoff_option=["activation_checkpointing_policy='auto'"])


def test_the_megatrain_preset_sets_its_arguments_and_the_command_line_wins():
    args = bench.parse_args(["--config", "megatrain_qwen25_7b"])
    assert {key: getattr(args, key) for key in MEGATRAIN} == MEGATRAIN
    assert args.config == "megatrain_qwen25_7b"
    assert args.batch * args.accumulate[0] * args.seq == 147_456  # tokens a step (MegaTrain's batch 148: 151,552)
    changed = bench.parse_args(["--config", "megatrain_qwen25_7b", "--batch", "4", "--accumulate", "37"])
    assert (changed.batch, changed.accumulate, changed.seq, changed.num_workers) == (4, [37], 1024, 4)
    plain = bench.parse_args([])
    assert (plain.config, plain.model, plain.batch, plain.accumulate) == (None, "gpt1b", 8, [1, 4])
    assert configs.record(None) is None
    assert configs.record("megatrain_qwen25_7b")["arguments"] == MEGATRAIN
    assert "examples/sft/configs/qwen_7b.yaml" in configs.record("megatrain_qwen25_7b")["source"]
    # the peers recompute every block; zoff's policy is its own default, "auto", which --zoff-option names
    options = runs.parse_options(args.zoff_option)
    assert runs.zoff_run_options("zoff", options, "tiny", None, args.activation_checkpointing)[
        "activation_checkpointing_policy"] == "auto"
    assert runs.zoff_run_options("zoff", {}, "tiny", None, True)["activation_checkpointing_policy"] == {
        runs.model_block("tiny")}


def test_qwen25_7b_has_the_published_shape_and_size():
    assert model_shapes.model_shape("qwen25_7b") == {"hf": "qwen25_7b", "block_size": 1024}
    assert bench.LOADER_WORKERS["qwen25_7b"] == 4
    family, kwargs = runs.family_of("qwen25_7b")
    with torch.device("meta"):  # shapes only
        module = family(**kwargs)
    config = module.model.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size,
            config.rope_parameters["rope_theta"], config.rms_norm_eps, config.tie_word_embeddings,
            config.max_position_embeddings) == (
            "qwen2", 3584, 28, 28, 4, 18944, 152064, 1e6, 1e-6, False, 32768)
    params = sum(p.numel() for p in module.parameters())
    assert params == 7_615_616_512
    assert round(params / 1e9, 2) == 7.62  # the published count, and MegaTrain's 6 x 7.62e9 x tokens
    assert runs.model_block("qwen25_7b").__name__ == "Qwen2DecoderLayer"


def test_fsdp2_cpu_offload_builds_the_model_on_the_cpu_and_keeps_it_there():
    build, strategy, _ = runs.build_run("fsdp2_cpu_offload", "tiny", {})
    module = build(None)
    assert {p.device.type for p in module.parameters()} == {"cpu"}
    # Lightning's ModelParallelStrategy moves the whole module to its device after configure_model: on a GPU that put
    # FSDP2's host shards there ("FSDP parameters should be materialized on CPU when enabling CPU offloading")
    away = torch.device("meta")  # a device other than the CPU, on a machine without a GPU
    plain = ModelParallelStrategy()
    plain.parallel_devices = [away]
    plain.model = runs.build_run("fsdp2_cpu_offload", "tiny", {})[0](None)
    plain.model_to_device()
    assert {p.device.type for p in plain.model.parameters()} == {"meta"}
    assert isinstance(strategy, ModelParallelStrategy)
    strategy.parallel_devices = [away]
    strategy.model = module
    strategy.model_to_device()
    assert {p.device.type for p in module.parameters()} == {"cpu"}


def test_lightning_fsdp_offloads_each_block_and_clips_by_its_own_norm():
    build, strategy, precision = runs.build_run("fsdp_cpu_offload", "tiny", {}, checkpointing=True)
    assert isinstance(strategy, FSDPStrategy)
    assert strategy.cpu_offload.offload_params is True
    assert precision == "bf16-mixed"
    module = build(None)
    assert {p.device.type for p in module.parameters()} == {"cpu"}
    block = runs.model_block("tiny")
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {block}
    assert strategy._activation_checkpointing_kwargs["auto_wrap_policy"]._module_classes == {block}
    clipped = []
    module._trainer = SimpleNamespace(model=SimpleNamespace(clip_grad_norm_=clipped.append))
    module.configure_gradient_clipping(None, 1.0, "norm")
    module.configure_gradient_clipping(None, None, None)
    assert clipped == [1.0]
    needs_gpu = "Lightning's FSDPStrategy needs a GPU accelerator"
    assert runs.unsupported_here("fsdp_cpu_offload", 1, False, gpus=0) == needs_gpu
    assert runs.unsupported_here("fsdp_cpu_offload", 1, False, gpus=1) is None


def assert_same_loss_and_gradients(plain, recomputed):
    """One forward and backward of each on the same tokens: the same loss and gradients, bit for bit (a parameter
    of a block in torch's checkpoint wrapper by its name without the wrapper's)."""
    x = torch.randint(0, 256, (2, 64))
    losses = []
    for module in (plain, recomputed):
        _, loss = module(x, x)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    grads = {name.replace("._checkpoint_wrapped_module", ""): p.grad for name, p in recomputed.named_parameters()}
    assert all(torch.equal(p.grad, grads[name]) for name, p in plain.named_parameters())


def test_every_run_recomputes_the_blocks_the_same_way():
    from lightning_zoff.examples.gpt import Block

    torch.manual_seed(0)
    plain = runs.build_run("gpu_only", "tiny", {})[0](None)
    recomputed = runs.build_run("gpu_only", "tiny", {}, checkpointing=True)[0](None)
    recomputed.load_state_dict(plain.state_dict())
    wrapped = [m for m in recomputed.modules() if isinstance(m, CheckpointWrapper)]
    assert len(wrapped) == 2
    assert all(isinstance(m._checkpoint_wrapped_module, Block) for m in wrapped)
    assert_same_loss_and_gradients(plain, recomputed)
    fsdp2 = runs.build_run("fsdp2_cpu_offload", "tiny", {}, checkpointing=True)[0](None)
    assert sum(isinstance(m, CheckpointWrapper) for m in fsdp2.modules()) == 2  # wrapped before sharding
    qwen3 = runs.build_run("zoff", "qwen3_tiny", {}, checkpointing=True)[1]
    assert {c.__name__ for c in qwen3.config.activation_checkpointing_policy} == {"Qwen3DecoderLayer"}


def test_a_model_built_under_zero_init_recomputes_its_blocks_without_a_new_module(monkeypatch):
    """DeepSpeed's ZeRO-3 runs build the model under zero.Init, which wraps every module's __init__; torch's
    checkpoint wrapper recursed there (RecursionError on the H100, session 23). Their blocks keep their class and
    recompute in backward with the plain run's loss and gradients."""
    from lightning_zoff.examples.gpt import Block
    from zoffbench.recompute import recompute_forwards

    torch.manual_seed(0)
    plain = runs.build_run("gpu_only", "tiny", {})[0](None)
    recomputed = runs.build_run("gpu_only", "tiny", {})[0](None)
    recomputed.load_state_dict(plain.state_dict())
    built = []
    init = torch.nn.Module.__init__
    monkeypatch.setattr(torch.nn.Module, "__init__", lambda self, *a, **k: (built.append(self), init(self, *a, **k)))
    recompute_forwards(recomputed, Block)
    monkeypatch.undo()
    assert built == []  # nothing for zero.Init to wrap
    assert [type(m) for m in recomputed.modules()] == [type(m) for m in plain.modules()]
    calls = []
    for block in recomputed.modules():
        if isinstance(block, Block):
            block.ln_1.register_forward_pre_hook(lambda *_: calls.append(1))
    assert_same_loss_and_gradients(plain, recomputed)
    assert len(calls) == 4  # each of the 2 blocks, once in forward and once again in backward's recompute
    family, kwargs = runs.family_of("tiny")
    with torch.device("meta"):  # as deepspeed_module builds it (its optimizer needs DeepSpeed: none here)
        module = runs.with_mixin(runs.BuiltUnderZeroInit, family)(**kwargs)
    module.recomputed = Block
    module.configure_model()  # what DeepSpeed's runs do under zero.Init
    blocks = [m for m in module.modules() if isinstance(m, Block)]
    assert len(blocks) == 2
    assert not any(isinstance(m, CheckpointWrapper) for m in module.modules())
    assert all(isinstance(b.forward, functools.partial) for b in blocks)


def test_torchao_is_unsupported_here_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # not importable, installed or not
    assert torchao_run.refusal(clip_asked=False, gpus=1).startswith("torchao is not installed (pip install torchao==")
    args = bench.parse_args(["--runs", "torchao_cpu_offload"])
    entry = bench.run_child(args, "torchao_cpu_offload", accumulate=4, steps=8, warmup=2)
    assert entry["outcome"] == "unsupported"
    assert entry["error"].startswith("torchao is not installed")
    assert "wall_s" not in entry  # no process started
    # never clipped: an inexact entry beside runs clipped at 1.0, exact in a call that clips none
    assert (entry["exact"], entry["gradient_clip_val"], entry["accumulate"]) == (False, None, 4)
    assert runs.inexact_because("torchao_cpu_offload", {}, 1.0).startswith("not clipped")
    assert runs.inexact_because("torchao_cpu_offload", {}, None) is None


def test_torchao_installed_needs_a_gpu_and_refuses_clipping_in_one_line(monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: name == "torchao" or found(name, *a))
    assert torchao_run.refusal(clip_asked=False, gpus=0).startswith("torchao's CPUOffloadOptimizer runs on a CUDA")
    assert torchao_run.refusal(clip_asked=False, gpus=1) is None
    args = bench.parse_args(["--runs", "torchao_cpu_offload", "zoff", "--clip", "1.0"])
    assert (args.clip, args.clip_asked) == (1.0, True)
    monkeypatch.setattr(bench, "machine", lambda: {"gpus": 1})
    entry = bench.run_child(args, "torchao_cpu_offload", accumulate=1, steps=8, warmup=2)
    assert entry["outcome"] == "unsupported"
    assert entry["error"] == ("torchao_cpu_offload clips no gradients (its documented use): run it without --clip, or"
                              " with --clip none")
    assert bench.parse_args(["--clip", "none"]).clip_asked is False


def test_the_torchao_loop_trains_and_measures_with_a_stand_in_optimizer():
    """torchao_run's loop on the CPU with torch's fused AdamW in CPUOffloadOptimizer's place (which asserts a CUDA
    or XPU device): the steps, phases and entry the GPU run will record."""
    from zoffbench.data import RandomTokens

    family, kwargs = runs.family_of("tiny")
    run = runs.bench_run("torchao_cpu_offload", "tiny", 2, 2, [], None, None, True)
    data = RandomTokens(vocab_size=256, seq=64, batch=2, length=2 * 2 * 3)
    adamw = torch.optim.AdamW
    entry = torchao_run.train_plainly(
        run, family, kwargs, lambda groups: adamw(groups, **runs.ADAMW, fused=True), data,
        recompute=runs.model_block("tiny"), accumulate=2, steps=2, warmup=1, batch=2, block_size=64,
        inexact_because="stand-in")
    assert (entry["name"], entry["gradient_clip_val"], entry["exact"], entry["activation_checkpointing"]) == (
        "torchao_cpu_offload", None, False, True)
    assert len(entry["steps"]) == 3
    assert entry["forward_s"] > 0
    assert entry["backward_s"] > 0
    assert entry["exposed_optimizer_s"] > 0
    assert entry["tokens_per_s"] == pytest.approx(2 * 2 * 64 / entry["step_s_median"])
    assert entry["params"] == sum(p.numel() for p in family(**kwargs).parameters())
    assert entry["phase_source"] == "synchronized loop"


def test_each_run_may_have_its_own_time_limit(monkeypatch):
    args = bench.parse_args(["--runs", "zoff", "torchao_cpu_offload", "--run-timeout-s", "200", "zoff=300"])
    assert args.run_timeout_s == {None: 200.0, "zoff": 300.0}
    assert bench.parse_args([]).run_timeout_s == {}  # no limit
    with pytest.raises(SystemExit):
        bench.parse_args(["--run-timeout-s", "zof=300"])  # argparse's error names the runs
    limits = []

    def started(function, kwargs, timeout_s, **_):
        limits.append(timeout_s)
        raise InterruptedError  # the process's limit is all this test reads

    monkeypatch.setattr(bench, "run_function", started)
    for name in ("zoff", "gpu_only"):
        with pytest.raises(InterruptedError):
            bench.run_child(args, name, accumulate=1, steps=1, warmup=1)
    assert limits == [300.0, 200.0]


def test_a_run_cut_after_its_training_ended_keeps_its_measurement(monkeypatch):
    """Session 23's MegaTrain run logged its last step and was cut at its limit before it reported (it reported when
    its function returned, after the teardown). It reports at the end of training now: a cut after that keeps the
    measurement, and says so; a cut before it is a timeout."""
    from zoffbench.harness import ChildRun

    args = bench.parse_args(["--runs", "zoff", "--run-timeout-s", "235"])
    measured = {"name": "zoff", "step_s_median": 19.0, "reported_at": 1000.0}

    def cut(reported):
        return lambda *a, **k: ChildRun(
            command=["serve"], output="capture", returncode=-9, timeout_s=235.0, timed_out=True, wall_s=235.0,
            ended_at=1004.5, peak_tree_rss=1, peak_rss_by_pid={}, peak_tree_pss=None, pss_read_s=None,
            results={0: measured} if reported else {}, stdout="", stderr="zoff rank 0: state: 7 unit(s) on the GPU\n")

    monkeypatch.setattr(bench, "run_function", cut(reported=True))
    entry = bench.run_child(args, "zoff", accumulate=18, steps=5, warmup=1)
    assert entry["step_s_median"] == 19.0
    assert entry["cut_after_measuring"] == "timed out after 235.0 s"
    assert entry["exit_s"] == pytest.approx(4.5)
    assert entry["zoff_lines"] == ["zoff rank 0: state: 7 unit(s) on the GPU"]
    assert "error" not in entry
    monkeypatch.setattr(bench, "run_function", cut(reported=False))
    entry = bench.run_child(args, "zoff", accumulate=18, steps=5, warmup=1)
    assert (entry["outcome"], entry["error"]) == ("timeout", "timed out after 235.0 s")


@pytest.mark.slow
def test_a_preset_call_records_its_config_and_every_peers_outcome(tmp_path):
    """The megatrain preset on the CPU: Lightning's FSDP (GPU only) and torchao (not installed, or no GPU) are
    entries with their reasons, and no run process starts (a few seconds)."""
    out = tmp_path / "bench.json"
    # bench.py's parent in this process: test_bench_cli runs its whole command line
    bench.main(["--config", "megatrain_qwen25_7b", "--runs", "fsdp_cpu_offload", "torchao_cpu_offload", "--out",
                str(out)])
    record = json.loads(out.read_text())
    assert record["config"]["name"] == "megatrain_qwen25_7b"
    assert record["config"]["arguments"] == MEGATRAIN
    fsdp, torchao = record["runs"]
    for entry in (fsdp, torchao):
        assert (entry["model"], entry["batch"], entry["accumulate"], entry["seq"], entry["num_workers"],
                entry["activation_checkpointing"], entry["outcome"]) == ("qwen25_7b", 8, 18, 1024, 4, True,
                                                                         "unsupported")
    assert fsdp["error"] == "Lightning's FSDPStrategy needs a GPU accelerator"
    assert fsdp["gradient_clip_val"] == 1.0
    assert torchao["error"] == torchao_run.refusal(clip_asked=False, gpus=0)
    assert (torchao["exact"], torchao["gradient_clip_val"]) == (False, None)


def test_a_second_call_adds_its_peers_to_the_first_calls_json(tmp_path, capsys):
    """Two calls of the megatrain preset, the second --add-to the first: one JSON, every run in call order, the first
    call named; another config or another kind of machine is refused in one line. The runs are refused here (no GPU,
    no torchao), so no process starts."""
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    bench.main(["--config", "megatrain_qwen25_7b", "--runs", "fsdp_cpu_offload", "--out", str(first)])
    bench.main(["--config", "megatrain_qwen25_7b", "--runs", "torchao_cpu_offload", "--add-to", str(first), "--out",
                str(second)])
    one = json.loads(first.read_text())
    both = json.loads(second.read_text())
    assert [r["name"] for r in both["runs"]] == ["fsdp_cpu_offload", "torchao_cpu_offload"]
    assert both["runs"][0] == one["runs"][0]
    assert both["earlier_calls"] == [{key: one[key] for key in ("date", "machine", "command")}]
    table = capsys.readouterr().out.split("machine:")[-1]
    assert "fsdp_cpu_offload" in table
    assert "torchao_cpu_offload" in table
    with pytest.raises(SystemExit, match=r"used --config megatrain_qwen25_7b .*give this call the same"):
        bench.main(["--runs", "fsdp_cpu_offload", "--add-to", str(first), "--out", str(tmp_path / "x.json")])
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({**one, "machine": {**one["machine"], "gpus": 1, "gpu": "NVIDIA H100 80GB HBM3"}}))
    with pytest.raises(SystemExit, match=r"made on NVIDIA H100 80GB HBM3 x1, .*same kind of machine"):
        bench.main(["--config", "megatrain_qwen25_7b", "--runs", "fsdp_cpu_offload", "--add-to", str(elsewhere),
                    "--out", str(tmp_path / "y.json")])


@pytest.mark.slow
def test_fsdp2_cpu_offload_trains_on_cpu_ranks(tmp_path):
    """FSDP2's CPUOffloadPolicy through bench.py's arguments on the CPU (gloo), blocks recomputed."""
    out = tmp_path / "bench.json"
    # bench.py's parent here; the run in a fresh process of its own
    bench.main(["--model", "tiny", "--runs", "fsdp2_cpu_offload", "--accumulate", "2", "--steps", "2", "--warmup", "1",
                "--batch", "2", "--activation-checkpointing", "--out", str(out)])
    (run,) = json.loads(out.read_text())["runs"]
    assert "error" not in run, run.get("stderr_tail")
    assert (run["name"], run["accumulate"], run["activation_checkpointing"], run["exact"]) == (
        "fsdp2_cpu_offload", 2, True, True)
    assert run["step_s_median"] > 0
    assert len(run["steps"]) == 3
