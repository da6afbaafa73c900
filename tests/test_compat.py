"""lightning_zoff._compat: each accessor of a private FSDP2 name still finds what zoff needs in this torch. These run
FSDP2 on one gloo rank in a forked child (the test process itself must not hold a process group)."""

from __future__ import annotations

import multiprocessing
import os
import traceback

import torch
from torch import nn

from lightning_zoff import _compat


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
        assert callable(getattr(_compat.MultiProcessingLauncher, name))
    assert callable(_compat.SubprocessScriptLauncher.launch)
    assert _compat.WorkerOutput._fields[:2] == ("best_model_path", "weights_path")
    params = list(inspect.signature(_compat.init_dist_connection).parameters)
    assert params[:2] == ["cluster_environment", "torch_distributed_backend"]
    assert params[-1] == "kwargs"  # timeout=
    assert "reduce_op" in inspect.signature(_compat.sync_ddp_if_available).parameters
    assert _compat.distributed_is_initialized() is False  # this process holds no process group


def test_hf_init_weights_is_the_models_own_init():
    transformers = __import__("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, initializer_range=0.5)
    model = transformers.LlamaForCausalLM(config)
    layer = model.model.layers[0].mlp.up_proj
    torch.nn.init.zeros_(layer.weight)
    _compat.hf_init_weights(model, layer)
    assert 0.3 < layer.weight.std().item() < 0.7  # normal(0, initializer_range), not left at zero
