"""lightning_zoff._compat: each accessor of a private FSDP2 name still finds what zoff needs in this torch. These run
FSDP2 on one gloo rank in a forked child (the test process itself must not hold a process group)."""

from __future__ import annotations

import multiprocessing
import os
import traceback

import pytest
import torch
from torch import nn

from lightning_zoff import _compat, _compat_lightning


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.frozen = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        x = self.frozen(self.a(x))
        return self.b(x) if use_b else x


def _in_one_rank(check, queue) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        torch.manual_seed(0)
        net = Net()
        fully_shard(net, mesh=init_device_mesh("cpu", (1,)))
        check(net)
        queue.put(None)
    except BaseException:  # the child's failure, whole, for the parent's assert
        queue.put(traceback.format_exc())


def run_in_one_rank(check) -> None:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_one_rank, args=(check, queue))
    child.start()
    error = queue.get(timeout=120)
    child.join()
    assert error is None, error


def _check_params_and_group(net) -> None:
    group = _compat.fsdp_param_group(net)
    assert group is not None
    assert len(group.fsdp_params) == 6
    params = _compat.unit_params(net)
    assert [p.shape for p in params] == [p.shape for p in net.parameters()]
    # the sharded parameters themselves, in order
    assert all(a is b for a, b in zip(params, net.parameters(), strict=True))


def test_unit_params_are_the_sharded_parameters_in_fsdp_order():
    run_in_one_rank(_check_params_and_group)


def _check_before_reduce(net) -> None:
    reports = []
    _compat.before_reduce(net, reports.append)
    _compat.before_reduce(net, reports.append)  # installing twice still reports once per reduce
    x = torch.randn(2, 4)
    net(x, use_b=False).sum().backward()
    # a.weight, a.bias, b.weight, b.bias require a gradient (FSDP2's order); b got none on this rank
    assert reports == [[True, True, False, False]], reports
    # ... and was reduced as zeros, so every rank reduces the same tensors
    assert torch.equal(net.b.weight.grad.to_local(), torch.zeros(4, 4))
    assert net.a.weight.grad is not None
    assert net.frozen.weight.grad is None
    _compat.restore_post_backward(net)
    net.zero_grad(set_to_none=True)
    net(x, use_b=False).sum().backward()
    assert len(reports) == 1
    assert net.b.weight.grad is None  # FSDP2's own behaviour again: no report, no zeros


def test_before_reduce_reports_unused_parameters_and_reduces_zeros_for_them():
    run_in_one_rank(_check_before_reduce)


def _check_streams(net) -> None:
    net(torch.randn(2, 4), use_b=True)
    streams = _compat.all_gather_streams(net)
    assert streams is not None
    assert len(streams) == 2


def test_all_gather_streams_are_found():
    run_in_one_rank(_check_streams)


def _check_finish_failed_backward(net) -> None:
    x = torch.randn(2, 4)

    def fail(grad):
        raise torch.OutOfMemoryError("injected")

    out = net(x, use_b=True)
    out.register_hook(fail)
    with pytest.raises(torch.OutOfMemoryError):
        out.sum().backward()
    _compat.finish_failed_backward(net)
    # FSDP2 starts over: the next backwards reduce every gradient, the same ones each time
    grads = []
    for _ in range(2):
        net.zero_grad(set_to_none=True)
        net(x, use_b=True).sum().backward()
        grads.append(net.a.weight.grad.to_local().clone())
    assert torch.equal(grads[0], grads[1])
    torch.manual_seed(0)  # the net as it was built, unsharded: autograd's own gradient
    reference = Net()
    reference(x, use_b=True).sum().backward()
    torch.testing.assert_close(grads[0], reference.a.weight.grad)


def test_finish_failed_backward_lets_fsdp2_train_on():
    run_in_one_rank(_check_finish_failed_backward)


def test_fused_adam_step_is_torchs_adamw():
    torch.manual_seed(0)
    param, grad = torch.randn(64), torch.randn(64)
    reference = param.clone().requires_grad_()
    reference.grad = grad.clone()
    torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1).step()
    exp_avg, exp_avg_sq = torch.zeros(64), torch.zeros(64)
    _compat.fused_adam_step(decoupled=True)(
        [param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(1.0)], lr=1e-2, beta1=0.9, beta2=0.999,
        weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
    torch.testing.assert_close(param, reference.detach(), rtol=1e-6, atol=1e-7)


def test_lightning_privates_zoff_builds_on():
    import inspect

    # the launchers zoff subclasses, with the methods it overrides or calls
    for name in ("_wrapping_function", "_collect_rank_zero_results", "_recover_results_in_main_process"):
        assert callable(getattr(_compat_lightning.MultiProcessingLauncher, name))
    assert callable(_compat_lightning.SubprocessScriptLauncher.launch)
    assert _compat_lightning.WorkerOutput._fields[:2] == ("best_model_path", "weights_path")
    params = list(inspect.signature(_compat_lightning.init_dist_connection).parameters)
    assert params[:2] == ["cluster_environment", "torch_distributed_backend"]
    assert params[-1] == "kwargs"  # timeout=
    assert "reduce_op" in inspect.signature(_compat_lightning.sync_ddp_if_available).parameters
    assert _compat_lightning.distributed_is_initialized() is False  # this process holds no process group
    # a module outside a Trainer calls its own batch hook
    module = __import__("lightning.pytorch", fromlist=["LightningModule"]).LightningModule()
    assert _compat_lightning.batch_hook(module, "on_before_batch_transfer", [1]) == [1]


def test_hf_init_weights_is_the_models_own_init():
    transformers = __import__("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, initializer_range=0.5)
    model = transformers.LlamaForCausalLM(config)
    layer = model.model.layers[0].mlp.up_proj
    torch.nn.init.zeros_(layer.weight)
    _compat.hf_init_weights(model, layer)
    assert 0.3 < layer.weight.std().item() < 0.7  # normal(0, initializer_range), not left at zero


def test_strategy_slots_that_lightning_reads():
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy("cpu")
    # none set (Lightning's property makes up a default)
    assert _compat_lightning.strategy_precision_plugin(strategy) is None
    plugin = Precision()
    _compat_lightning.set_strategy_precision_plugin(strategy, plugin)
    assert strategy.precision_plugin is plugin
    assert _compat_lightning.strategy_precision_plugin(strategy) is plugin
    launcher = _compat_lightning.MultiProcessingLauncher(strategy, start_method="fork")
    _compat_lightning.set_strategy_launcher(strategy, launcher)
    assert strategy.launcher is launcher  # Lightning's own property reads it
    assert _compat_lightning.launcher_strategy(launcher) is strategy


def test_the_trainer_takes_zoffs_launcher_and_precision():
    import lightning.pytorch as pl

    from lightning_zoff import ZoffPrecision, ZoffStrategy
    from lightning_zoff.trainer.launchers import ZoffMultiProcessingLauncher

    # Lightning calls the strategy's `_configure_launcher` (zoff overrides it) and sets its precision plugin
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZoffStrategy(start_method="fork"), logger=False,
                         precision="bf16-mixed")
    assert isinstance(trainer.strategy.launcher, ZoffMultiProcessingLauncher)
    assert isinstance(_compat_lightning.strategy_precision_plugin(trainer.strategy), ZoffPrecision)
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"


def test_direct_tensors_are_a_modules_own_and_replace_in_place():
    norm = nn.BatchNorm1d(3)
    norm.register_buffer("scratch", torch.zeros(3), persistent=False)
    assert _compat.direct_tensors(nn.Sequential(norm)) == []  # its child's, not its own
    assert [(kind, name) for kind, name, _ in _compat.direct_tensors(norm)] == [
        ("param", "weight"), ("param", "bias"), ("buffer", "running_mean"), ("buffer", "running_var"),
        ("buffer", "num_batches_tracked"), ("buffer", "scratch")]
    weight, scratch = nn.Parameter(torch.full((3,), 2.0)), torch.ones(3)
    _compat.replace_direct_tensor(norm, "param", "weight", weight)
    _compat.replace_direct_tensor(norm, "buffer", "scratch", scratch)
    assert norm.weight is weight
    assert dict(norm.named_parameters())["weight"] is weight
    assert norm.scratch is scratch
    assert "scratch" not in norm.state_dict()  # still not persistent


class CountingLinear(nn.Linear):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(super().forward(x))


def test_checkpoint_activations_of_recomputes_the_forward_in_backward():
    torch.manual_seed(0)
    checkpointed, plain = CountingLinear(4, 4), CountingLinear(4, 4)
    plain.load_state_dict(checkpointed.state_dict())
    _compat.checkpoint_activations_of(checkpointed)
    x = torch.randn(2, 4)
    checkpointed(x).sum().backward()
    plain(x).sum().backward()
    assert (checkpointed.calls, plain.calls) == (2, 1)  # run again in backward, for the activations it dropped
    torch.testing.assert_close(checkpointed.weight.grad, plain.weight.grad)
    assert [name for name, _ in checkpointed.named_parameters()] == ["weight", "bias"]  # no wrapper


def test_dcp_data_extents_are_the_files_dcp_wrote(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, no group, on purpose
        warnings.simplefilter("ignore")
        dcp.save({"a": torch.randn(16), "b": torch.randn(4, 4)}, checkpoint_id=tmp_path)
    extents = _compat.dcp_data_extents(dcp.FileSystemReader(tmp_path).read_metadata())
    assert sum(extents.values()) >= 2 * 16 * 4, extents  # both tensors' bytes, in files the index names
    for name, size in extents.items():
        assert 0 < size <= (tmp_path / name).stat().st_size


def test_is_view_and_apply_to_tensors_see_what_fsdp2_sees():
    import dataclasses

    x = torch.randn(2, 3, 4, requires_grad=True)
    view, own = nn.Linear(4, 5)(x), nn.Linear(4, 5, bias=False)(x)  # torch reshapes the biased 2-d result: a view
    assert _compat.is_view(view)
    assert not _compat.is_view(own)

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        extra: tuple

    out = _compat.apply_to_tensors(torch.neg, Out(view, ([own], {"k": own}, 3)))
    assert isinstance(out, Out)
    torch.testing.assert_close(out.logits, -view)
    assert isinstance(out.extra[0], list)
    assert out.extra[2] == 3
    torch.testing.assert_close(out.extra[1]["k"], -own)


def test_optimizers_of_reads_every_form_configure_optimizers_may_return():
    import pytest

    opt_a, opt_b = (torch.optim.AdamW([nn.Parameter(torch.zeros(2))]) for _ in range(2))
    scheduler = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1)
    assert _compat_lightning.optimizers_of(opt_a) == [opt_a]
    assert _compat_lightning.optimizers_of([opt_a, opt_b]) == [opt_a, opt_b]
    assert _compat_lightning.optimizers_of({"optimizer": opt_a, "lr_scheduler": scheduler}) == [opt_a]
    assert _compat_lightning.optimizers_of(([opt_a], [scheduler])) == [opt_a]
    assert _compat_lightning.optimizers_of([{"optimizer": opt_a}, {"optimizer": opt_b}]) == [opt_a, opt_b]
    with pytest.raises(Exception, match="Unknown configuration"):
        _compat_lightning.optimizers_of("adamw")


def test_this_torch_lets_zoff_ask_for_expandable_cuda_segments():
    # set on CUDA ranks only, so this CPU run checks the setter zoff calls is there (the GPU run uses it)
    assert callable(torch._C._accelerator_setAllocatorSettings)
