"""How the tests compare two runs' numbers."""

from __future__ import annotations

import torch


def rel_err(a, b) -> float:
    """The largest relative error of `a` against `b` (sequences or tensors of the same shape), computed in fp64."""
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ((a - b).abs() / b.abs()).max().item()
