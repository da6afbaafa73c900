"""lightning_zoff.optim as plain torch optimizers: same results and state_dict shape as torch's."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from lightning_zoff.optim import Adam, AdamW, Lion


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(17, 5), (63,), (4099,)]]


def grads_for(step, params, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(dtype) for p in params]


def run(opt_cls, params, steps, grad_dtype=torch.float32, schedule=True, **kw):
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0, "lr": 2e-3}]
    opt = opt_cls(groups, lr=1e-3, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5) if schedule else None
    for step in range(steps):
        for p, g in zip(params, grads_for(step, params, grad_dtype), strict=True):
            if grad_dtype != p.dtype:
                p.grad_dtype = None  # torch >= 2.10: let an fp32 parameter hold a 16-bit gradient
                p.grad = g
            else:
                p.grad = g.to(p.dtype)
        opt.step()
        if sched:
            sched.step()
    return opt


@pytest.mark.parametrize(("ours", "theirs"), [(AdamW, torch.optim.AdamW), (Adam, torch.optim.Adam)])
def test_matches_torch_and_state_dict_shape(ours, theirs):
    a, b = make_params(), make_params()
    opt_a = run(ours, a, 30, betas=(0.9, 0.95), eps=1e-6)
    opt_b = run(theirs, b, 30, betas=(0.9, 0.95), eps=1e-6)
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        assert sa["state"][k].keys() == sb["state"][k].keys()
        for name in sa["state"][k]:
            assert sa["state"][k][name].shape == sb["state"][k][name].shape
    assert [g["lr"] for g in sa["param_groups"]] == [g["lr"] for g in sb["param_groups"]]


def test_bf16_grads_match_torch_fed_the_same_values():
    a, b = make_params(), make_params()
    run(AdamW, a, 25, grad_dtype=torch.bfloat16)
    groups_b = [{"params": b[:1], "weight_decay": 0.1}, {"params": b[1:], "weight_decay": 0.0, "lr": 2e-3}]
    opt_b = torch.optim.AdamW(groups_b, lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt_b, step_size=7, gamma=0.5)
    for step in range(25):
        for p, g in zip(b, grads_for(step, b, torch.bfloat16), strict=True):
            p.grad = g.float()
        opt_b.step()
        sched.step()
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_load_state_dict_continues_identically():
    a, b = make_params(), make_params()
    opt_a = run(AdamW, a, 10, schedule=False)
    opt_b = AdamW([{"params": b[:1], "weight_decay": 0.1}, {"params": b[1:], "weight_decay": 0.0, "lr": 2e-3}], lr=1e-3)
    with torch.no_grad():
        for pa, pb in zip(a, b, strict=True):
            pb.copy_(pa)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # a live state_dict shares tensors
    for step in range(10, 15):
        for params, opt in ((a, opt_a), (b, opt_b)):
            for p, g in zip(params, grads_for(step, params), strict=True):
                p.grad = g
            opt.step()
    for pa, pb in zip(a, b, strict=True):
        assert torch.equal(pa, pb)


def reference_lion(params, steps, lr, betas, wd):
    ms = [torch.zeros_like(p) for p in params]
    directions = []
    for step in range(steps):
        for p, m, g in zip(params, ms, grads_for(step, params), strict=True):
            c = m * betas[0] + g * (1 - betas[0])
            directions.append(c)
            p.data.mul_(1 - lr * wd).add_(torch.sign(c), alpha=-lr)
            m.mul_(betas[1]).add_(g, alpha=1 - betas[1])
    return directions


def test_lion_matches_its_definition_elementwise():
    a, b = make_params(), make_params()
    opt = Lion(a, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    for step in range(25):
        for p, g in zip(a, grads_for(step, a), strict=True):
            p.grad = g
        opt.step()
    directions = reference_lion(b, 25, 1e-3, (0.9, 0.99), 0.1)
    near_zero = [c.abs() < 1e-6 for c in directions[-len(a):]]
    for pa, pb, skip in zip(a, b, near_zero, strict=True):
        diff = (pa - pb).abs()[~skip]
        assert diff.max() <= 1e-6, diff.max()  # each step moves by lr x (-1, 0, 1): any wrong sign shows as 2e-3


def test_bad_parameters_are_refused():
    p = torch.nn.Parameter(torch.randn(8, 8).double())
    p.grad = torch.randn(8, 8).double()
    with pytest.raises(TypeError, match="fp32 CPU parameters"):
        AdamW([p]).step()
    q = torch.nn.Parameter(torch.randn(8, 8))
    q.grad = torch.randn(8, 16)[:, ::2]  # non-contiguous
    with pytest.raises((ValueError, RuntimeError), match="contiguous"):
        AdamW([q]).step()


@pytest.mark.parametrize("rule_name", ["ADAMW", "ADAM", "LION"])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_accelerator_path_agrees_with_the_kernel(rule_name, moment_dtype):
    # zoff_no_offload updates with torch ops on the accelerator; run that code on CPU tensors against the kernel
    from lightning_zoff.optim.rules import GroupHyperparams, UpdateRule
    from lightning_zoff.optim.update import _cpu_update, _torch_update

    rule = UpdateRule[rule_name]
    hp = GroupHyperparams(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, maximize=False)
    g = torch.Generator().manual_seed(0)
    state = [torch.randn(4099, generator=g) for _ in range(3)]
    state[2] = state[2].abs()  # second moments are non-negative
    state[1:] = [t.to(moment_dtype) for t in state[1:]]
    a = [t.clone() for t in state]
    b = [t.clone() for t in state]
    out_a, out_b = torch.empty(4099, dtype=torch.bfloat16), torch.empty(4099, dtype=torch.bfloat16)
    for step in range(1, 6):
        grad = torch.randn(4099, generator=g).to(torch.bfloat16)
        second_a = None if rule is UpdateRule.LION else a[2]
        second_b = None if rule is UpdateRule.LION else b[2]
        _cpu_update(rule, hp, step, a[0], grad, a[1], second_a, 0.5, out_a, None, None)
        _torch_update(rule, hp, step, b[0], grad, b[1], second_b, 0.5, out_b)
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
    assert (out_a.float() - out_b.float()).abs().max() <= 2 ** -7 * a[0].abs().max()
    assert a[1].dtype == b[1].dtype == moment_dtype  # the torch path keeps bf16 moments bf16, rounded alike
    torch.testing.assert_close(a[1].float(), b[1].float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("rule_name", ["ADAMW", "ADAM", "LION"])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("maximize", [False, True])
def test_updating_many_runs_at_once_gives_the_bits_of_one_update_each(rule_name, moment_dtype, maximize):
    # the accelerator's units update all of a run's parameters in one fused call (`update_many`): against `update`
    # on each, bit for bit, over a few steps with a grad scale
    from lightning_zoff.optim.rules import GroupHyperparams, UpdateRule
    from lightning_zoff.optim.update import update, update_many

    rule = UpdateRule[rule_name]
    hp = GroupHyperparams(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, maximize=maximize)
    g = torch.Generator().manual_seed(1)
    sizes = [257, 1, 4096, 33]
    state = [torch.randn(sum(sizes), generator=g) for _ in range(3)]
    state[2] = state[2].abs()
    state[1:] = [t.to(moment_dtype) for t in state[1:]]
    one, many = [t.clone() for t in state], [t.clone() for t in state]
    second = rule is not UpdateRule.LION
    for step in range(1, 5):
        grads = [torch.randn(n, generator=g).to(torch.bfloat16) for n in sizes]
        rows = [slice(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
        for r, grad in zip(rows, grads, strict=True):
            update(rule, hp, step, one[0][r], grad, one[1][r], one[2][r] if second else None, grad_scale=0.25,
                   on_host=False)
        update_many(rule, hp, step, [many[0][r] for r in rows], grads, [many[1][r] for r in rows],
                    [many[2][r] for r in rows] if second else None, grad_scale=0.25)
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(one[0], state[0])  # the steps changed the parameters


def test_an_accelerator_units_run_is_updated_in_batches_bounded_by_the_workspace():
    from lightning_zoff.offload.updates import _batches

    pieces = [(offset, torch.empty(n)) for offset, n in [(0, 3), (3, 4), (7, 10), (17, 2), (19, 1), (20, 6)]]
    batches = _batches(pieces, 8)
    assert [[offset for offset, _ in batch] for batch in batches] == [[0, 3], [7], [17, 19], [20]]


def test_the_sum_of_squares_of_an_accelerator_units_shards_against_fp64():
    from lightning_zoff.offload.grad_math import sum_of_squares_of

    g = torch.Generator().manual_seed(2)
    shards = [torch.randn(n, generator=g).to(torch.bfloat16) for n in (1000, 1, 37)]
    expected = sum(float(t.double().square().sum()) for t in shards)
    assert sum_of_squares_of(shards) == pytest.approx(expected, rel=1e-6)
    assert sum_of_squares_of([]) == 0.0
    shards[2][5] = float("inf")
    assert sum_of_squares_of(shards) == float("inf")
    shards[0][0] = float("nan")
    assert math.isnan(sum_of_squares_of(shards))
