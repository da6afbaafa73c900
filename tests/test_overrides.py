"""Every method of lightning_zoff that overrides one of a base class (Lightning's, torch's, the standard library's)
says so with `@override`, as Lightning's own code does: a base method renamed upstream then shows at once."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import lightning_zoff

# not checked: the engine and the tensor-level checkpoint code
NOT_CHECKED = ("lightning_zoff.offload", "lightning_zoff.checkpoint", "lightning_zoff.ops", "lightning_zoff.optim")
# set by Python itself or by dataclasses, not written by us as overrides
IMPLICIT = {"__init__", "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
            "__firstlineno__", "__static_attributes__", "__orig_bases__", "__parameters__", "__abstractmethods__",
            "_abc_impl", "__hash__", "__eq__", "__repr__", "__match_args__", "__dataclass_fields__",
            "__dataclass_params__", "__slots__"}


def _modules() -> list[str]:
    names = [info.name for info in pkgutil.walk_packages(lightning_zoff.__path__, "lightning_zoff.")]
    return [n for n in names if not n.startswith(NOT_CHECKED) and not n.endswith("__main__")]


def _unmarked(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    missing = []
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module_name:
            continue
        for name, attr in vars(cls).items():
            if name in IMPLICIT or not any(name in vars(base) for base in cls.__mro__[1:-1]):
                continue
            functions = [attr.fget, attr.fset] if isinstance(attr, property) else [getattr(attr, "__func__", attr)]
            if not all(getattr(f, "__override__", False) for f in functions if f is not None):
                missing.append(f"{cls.__name__}.{name}")
    return missing


@pytest.mark.parametrize("module_name", _modules())
def test_overrides_are_marked(module_name):
    assert _unmarked(module_name) == []
