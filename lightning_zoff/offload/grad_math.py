"""The two sums a unit's window gradient needs, on the host with zoff's kernels (they run on the rank's optimizer
threads; torch's own pool is small there) and elsewhere with torch."""

from __future__ import annotations

import torch

from lightning_zoff import ops


def accumulate(total: torch.Tensor, shard: torch.Tensor, *, replace: bool, kernel: bool, threads: int | None
               ) -> torch.Tensor:
    """`total` += `shard` (or = with `replace`), promoting the shard's dtype; returns `total`."""
    if kernel:
        ops.accumulate(total, shard, replace=replace, threads=threads)
    elif replace:
        total.copy_(shard)
    else:
        total.add_(shard)
    return total


def sum_of_squares(grad: torch.Tensor, spans: list[tuple[int, int]], *, kernel: bool, threads: int | None) -> float:
    """Of the gradient's elements in `spans` (the trained parameters': clipping, like Lightning's, takes the
    optimizer's parameters only); inf or NaN when any is not finite."""
    total = 0.0
    for start, end in spans:
        if kernel:
            total += ops.grad_sumsq_finite(grad[start:end], threads=threads)[0]
        else:
            total += torch.linalg.vector_norm(grad[start:end], dtype=torch.float32).double().item() ** 2
    return total


def sum_of_squares_of(tensors: list[torch.Tensor]) -> float:
    """Of every element of `tensors` (accelerator tensors: one multi-tensor norm and one wait for the accelerator, not
    a launch and a wait per tensor); inf or NaN when any is not finite."""
    if not tensors:
        return 0.0
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).double()
    return float(norms.square().sum().item())
