"""The house: a core that imports no Lightning, and two front doors that importing the package registers, whichever
comes first. Each check runs in a fresh Python process, so what this one imported does not count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
CORE = ("lightning_zoff.offload", "lightning_zoff.training", "lightning_zoff.sharding", "lightning_zoff.checkpoint",
        "lightning_zoff.checkpoint.consolidate", "lightning_zoff.config", "lightning_zoff.precision_math",
        "lightning_zoff.optim", "lightning_zoff.ops")


def python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_the_core_loads_neither_lightning_pytorch_nor_lightning_fabric():
    loaded = python(f"import sys\nfor m in {CORE!r}: __import__(m)\n"
                    "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lightning'))")
    assert loaded == "[]"


def test_importing_the_package_registers_both_doors_when_lightning_comes_after_it():
    out = python("import sys\nimport lightning_zoff\nassert 'lightning' not in sys.modules\n"
                 "from lightning.fabric import Fabric\nfrom lightning.pytorch import Trainer\n"
                 "fabric = Fabric(accelerator='cpu', devices=2, strategy='zoff')\n"
                 "trainer = Trainer(accelerator='cpu', devices=2, strategy='zoff_no_offload', logger=False)\n"
                 "print(type(fabric.strategy).__name__, type(trainer.strategy).__name__)")
    assert out.splitlines()[-1] == "ZoffFabricStrategy ZoffStrategy"


def test_importing_the_package_registers_both_doors_when_lightning_came_before_it():
    out = python("from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
                 "from lightning.pytorch.strategies import StrategyRegistry\nimport lightning_zoff\n"
                 "print(sorted(n for n in (*STRATEGY_REGISTRY, *StrategyRegistry) if n.startswith('zoff')))")
    assert out == "['zoff', 'zoff', 'zoff_no_offload', 'zoff_no_offload']"
