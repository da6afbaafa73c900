"""The host kernels' update in torch ops (`optim.host_math`) on the GPU gives the CPU kernels' bits: what makes a step's
choice of units to lend to the GPU (`offload/lending.py`) change no result."""

from __future__ import annotations

import pytest
import torch

from lightning_zoff.optim.host_math import update_as_host
from lightning_zoff.optim.rules import UpdateRule
from test_host_math import CASES, N, kernel_update  # the CPU test's cases (tests/ is on the path: its conftest)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_gives_the_host_kernels_bits(case, grad_dtype, moment_dtype):
    rule, hp = CASES[case]
    gen = torch.Generator().manual_seed(3)
    moments = 1 if rule is UpdateRule.LION else 2
    kernel_state = [torch.randn(N, generator=gen)] + [torch.zeros(N, dtype=moment_dtype) for _ in range(moments)]
    gpu_state = [t.cuda() for t in kernel_state]
    for step in range(1, 6):
        grad = (torch.randn(N, generator=gen) * 10 ** torch.randint(-6, 3, (N,), generator=gen)).to(grad_dtype)
        scale = 0.37 / step
        kernel_update(rule, hp, step, kernel_state[0], grad, kernel_state[1], kernel_state[2] if moments == 2 else None,
                      scale, None)
        update_as_host(rule, hp, step, gpu_state[0], grad.cuda(), gpu_state[1], gpu_state[2] if moments == 2 else None,
                       grad_scale=scale)
        for ours, theirs in zip(gpu_state, kernel_state, strict=True):
            assert torch.equal(ours.cpu(), theirs), (case, step, (ours.cpu().float() - theirs.float()).abs().max())
