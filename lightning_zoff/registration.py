"""The strategy names in Lightning's two registries: ``"zoff"`` and ``"zoff_no_offload"`` for
`Trainer(strategy=...)` and for `Fabric(strategy=...)`.

`import lightning_zoff` registers them, but must not import Lightning itself: the core (`lightning_zoff.offload` and
the modules it uses) is imported through the same package, and it stays free of Lightning. So the names go in as soon
as Lightning is there: at once when it is imported already, else right after its first import (importing any part of
``lightning`` runs its top-level package, which builds both registries). That import may come from a front door's own
module midway through its import, so a registry entry names the door's class by its module, imported when a Trainer
or Fabric resolves the name (Lightning's registries call what they hold with the registered options).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from typing_extensions import override


def register_with_lightning() -> None:
    """Register the names now if Lightning is imported, else once it is."""
    if "lightning" in sys.modules:
        register()
    elif not any(isinstance(finder, _AfterLightning) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightning())


NAMES = {
    "zoff": ("ZeRO-3 (FSDP2) with the optimizer and fp32 master offloaded to the CPU", {"offload": True}),
    "zoff_no_offload": ("ZeRO-3 (FSDP2) with the optimizer on the accelerator", {"offload": False}),
}


def register() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    doors = ((StrategyRegistry, "lightning_zoff.trainer.strategy", "ZoffStrategy"),
             (STRATEGY_REGISTRY, "lightning_zoff.fabric.strategy", "ZoffFabricStrategy"))
    for registry, module, name in doors:
        for strategy_name, (description, options) in NAMES.items():
            if strategy_name not in registry:
                registry.register(strategy_name, _Door(module, name), description=description, **options)


class _Door:
    """A front door's strategy class, named by its module: calling it imports the module and builds the strategy."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, **options: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.name)(**options)

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


class _AfterLightning(importlib.abc.MetaPathFinder):
    """Finds ``lightning`` as Python would, then registers once its package has run. It takes itself out of
    `sys.meta_path` at that first import: it never runs again."""

    @override
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "lightning":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfter(spec.loader)
        return spec


class _RegisterAfter(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    @override
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    @override
    def exec_module(self, module: ModuleType) -> None:
        # the module as if imported plainly: its own loader, as `importlib` and Lightning may ask for it
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        register()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
