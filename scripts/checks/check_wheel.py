"""An installed lightning_zoff builds its kernels from the sources it ships and runs them (CI's wheel step).

    python -m pip wheel --no-deps -w /tmp/w/dist .
    python -m pip install --no-deps --target /tmp/w/site /tmp/w/dist/*.whl
    cd /tmp/w && PYTHONPATH=/tmp/w/site ZOFF_CACHE_DIR=/tmp/w/cache python /path/to/scripts/checks/check_wheel.py

Fails unless lightning_zoff is imported from outside this checkout, the kernels are built now (the cache directory
holds no build yet) from the package's own csrc/, and one fused AdamW step equals torch.optim.AdamW's.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import lightning_zoff
from lightning_zoff import ops
from lightning_zoff.ops import build

CHECKOUT = Path(__file__).resolve().parents[2]
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def main() -> None:
    package = Path(lightning_zoff.__file__).resolve().parent
    if package.is_relative_to(CHECKOUT):
        sys.exit(f"lightning_zoff was imported from the checkout ({package}), not from the installed wheel")
    if build.CSRC.resolve() != package / "csrc":
        sys.exit(f"the kernels' sources are read from {build.CSRC}, not from the package ({package / 'csrc'})")
    if "ZOFF_CACHE_DIR" not in os.environ or build.cache_dir().exists():
        sys.exit("set ZOFF_CACHE_DIR to an empty directory, so that the kernels are built from the wheel's sources")

    start = time.perf_counter()
    ops.load()
    built_s = time.perf_counter() - start

    gen = torch.Generator().manual_seed(0)
    param, grad = torch.randn(4099, generator=gen), torch.randn(4099, generator=gen)
    reference = param.clone().requires_grad_()
    reference.grad = grad.clone()
    torch.optim.AdamW([reference], **HYPER).step()
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    beta1, beta2 = HYPER["betas"]
    ops.adam_step(param, grad, exp_avg, exp_avg_sq, lr=HYPER["lr"], beta1=beta1, beta2=beta2, eps=HYPER["eps"],
                  weight_decay=HYPER["weight_decay"], step=1, decoupled=True)
    torch.testing.assert_close(param, reference.detach())
    print(f"wheel OK: lightning_zoff from {package}, kernels built in {built_s:.0f} s into {build.cache_dir()},"
          f" ISA {ops.selected_isa()}; one AdamW step equals torch.optim.AdamW's"
          f" (max |diff| {(param - reference.detach()).abs().max().item():.1e})")


if __name__ == "__main__":
    main()
