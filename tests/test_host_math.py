"""`optim.host_math`: the host kernels' update in torch ops gives the kernels' bits, for every kernel build this CPU
runs, over several steps (so the moments' history matters), each rule and option: the accelerator's share of the host's
updates (`offload/lending.py`) must leave the state exactly as the host would."""

from __future__ import annotations

import pytest
import torch

from lightning_zoff import ops
from lightning_zoff.optim.host_math import update_as_host
from lightning_zoff.optim.rules import GroupHyperparams, UpdateRule

ISAS = ops.available_isas()
N = 4099  # whole vectors and a tail on every build
CASES = {
    "adamw": (UpdateRule.ADAMW, GroupHyperparams(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                                                 maximize=False)),
    "adam_l2": (UpdateRule.ADAM, GroupHyperparams(lr=1e-3, beta1=0.8, beta2=0.999, eps=1e-6, weight_decay=0.01,
                                                  maximize=False)),
    "adam_beta1_small_maximize": (UpdateRule.ADAM, GroupHyperparams(lr=1e-2, beta1=0.3, beta2=0.99, eps=1e-8,
                                                                    weight_decay=0.0, maximize=True)),
    "lion": (UpdateRule.LION, GroupHyperparams(lr=1e-4, beta1=0.9, beta2=0.99, eps=0.0, weight_decay=0.1,
                                               maximize=False)),
}


def kernel_update(rule, hp, step, param, grad, m, v, scale, isa):
    if rule is UpdateRule.LION:
        ops.lion_step(param, grad, m, lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay,
                      grad_scale=scale, maximize=hp.maximize, isa=isa, threads=1)
    else:
        ops.adam_step(param, grad, m, v, lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, eps=hp.eps,
                      weight_decay=hp.weight_decay, step=step, decoupled=rule is UpdateRule.ADAMW,
                      maximize=hp.maximize, grad_scale=scale, isa=isa, threads=1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_torch_ops_give_the_kernels_bits(isa, case, grad_dtype, moment_dtype):
    rule, hp = CASES[case]
    gen = torch.Generator().manual_seed(3)
    param = torch.randn(N, generator=gen)
    param[:3] = 0.0  # zeros: Lion's sign, Adam's first step
    moments = 1 if rule is UpdateRule.LION else 2
    kernel_state = [param.clone()] + [torch.zeros(N, dtype=moment_dtype) for _ in range(moments)]
    torch_state = [t.clone() for t in kernel_state]
    for step in range(1, 6):
        grad = (torch.randn(N, generator=gen) * 10 ** torch.randint(-6, 3, (N,), generator=gen)).to(grad_dtype)
        grad[5] = 0.0
        scale = 0.37 / step
        kernel_update(rule, hp, step, kernel_state[0], grad, kernel_state[1], kernel_state[2] if moments == 2 else None,
                      scale, isa)
        update_as_host(rule, hp, step, torch_state[0], grad, torch_state[1],
                       torch_state[2] if moments == 2 else None, grad_scale=scale)
        for name, ours, theirs in zip(["param", "exp_avg", "exp_avg_sq"], torch_state, kernel_state, strict=False):
            assert torch.equal(ours.view(torch.int16 if ours.dtype == torch.bfloat16 else torch.int32),
                               theirs.view(torch.int16 if theirs.dtype == torch.bfloat16 else torch.int32)), \
                (name, step, (ours.float() - theirs.float()).abs().max())
