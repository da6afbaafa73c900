"""Every method of lightning_zoff that overrides one of a base class (Lightning's, torch's, the standard library's)
says so with `@override`, as Lightning's own code does: a base method renamed upstream then shows at once."""

from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil

import pytest

import lightning_zoff

# set by Python itself or by dataclasses, not written by us as overrides
IMPLICIT = {"__init__", "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
            "__firstlineno__", "__static_attributes__", "__orig_bases__", "__parameters__", "__abstractmethods__",
            "_abc_impl", "__hash__", "__eq__", "__repr__", "__match_args__", "__dataclass_fields__",
            "__dataclass_params__", "__slots__", "_is_protocol", "_is_runtime_protocol", "__protocol_attrs__",
            "__non_callable_proto_members__", "__subclasshook__",
            "_backward_cls"}  # the last: made by torch.autograd.Function's metaclass


def _modules() -> list[str]:
    names = [info.name for info in pkgutil.walk_packages(lightning_zoff.__path__, "lightning_zoff.")]
    return [n for n in names if not n.endswith("__main__")]


def _unmarked(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    missing = []
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module_name:
            continue
        for name, attr in vars(cls).items():
            sunder = name.startswith("_") and name.endswith("_") and not name.startswith("__")  # enum's own members
            by_enum = sunder or (name == "__new__" and issubclass(cls, enum.Enum))
            if name in IMPLICIT or by_enum or not any(name in vars(base) for base in cls.__mro__[1:-1]):
                continue
            functions = [attr.fget, attr.fset] if isinstance(attr, property) else [getattr(attr, "__func__", attr)]
            if not all(getattr(f, "__override__", False) for f in functions if f is not None):
                missing.append(f"{cls.__name__}.{name}")
    return missing


@pytest.mark.parametrize("module_name", _modules())
def test_overrides_are_marked(module_name):
    assert _unmarked(module_name) == []
