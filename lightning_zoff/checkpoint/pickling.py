"""How a checkpoint's objects other than its tensors are pickled: modules in it (a network the LightningModule took
as an argument and keeps in its hyperparameters) as the user built them, and a one-line refusal, before anything is
written, of what cannot be pickled.

`fully_shard` swaps each sharded module's class for a generated ``FSDP<Name>`` class that pickle cannot find by
name, and leaves the module holding one rank's shards (DTensors), its own hooks and its state. A module here is
pickled as its own class (the generated class's base), without that machinery, and with its sharded parameters
written as their full shapes only: one rank's rows mean nothing in a file, and the values are in the checkpoint's
state dict, which Lightning's ``load_from_checkpoint`` (``Model(**hyper_parameters)``, then ``load_state_dict``)
loads into the empty tensors rebuilt here. Everything else (buffers, plain parameters of modules outside the model,
the user's hooks) is pickled as DDP pickles it.

Only torch's and the standard library's functions rebuild them, so the files load without lightning_zoff installed,
as DDP's do (with ``weights_only=False``, which torch asks for any file that holds the user's classes).
"""

from __future__ import annotations

import copyreg
import functools
import os
import pickle
from collections.abc import Iterator
from typing import IO, Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from typing_extensions import override

# the state `fully_shard` and torch's composable APIs (activation checkpointing too) keep in a module's __dict__
_SHARDING_KEYS = ("__composable_api_state_key", "_fsdp", "_is_fsdp")
# hooks of the sharding machinery (FSDP2's, zoff's gates and views): bound to this process's ranks and streams
_SHARDING_CODE = ("torch.distributed", "lightning_zoff")
# which hooks take kwargs or always run, keyed by hook id: they follow the hooks kept
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


class UnpicklableCheckpoint(pickle.PicklingError):
    """Part of a checkpoint that pickle cannot store; the message says which and how to leave it out."""


def save(obj: Any, file: IO[bytes] | str | os.PathLike[str]) -> None:
    """`torch.save`, with the modules in `obj` pickled as their own classes without sharded weights."""
    torch.save(obj, file, pickle_module=_PickleModule)


def check_picklable(obj: dict[str, Any]) -> str | None:
    """Why `save` would fail on the checkpoint `obj`, in one line, or None. Pickles its structure to nowhere (the
    tensors' bytes are left out), so that a save refused writes nothing."""
    try:
        _dry_run(obj)
        return None
    except Exception as err:
        path, culprit_err = _culprit(obj, err)
    reason = " ".join(str(culprit_err).split())
    where = "checkpoint" + "".join(f"[{key!r}]" for key in path)
    if len(path) == 2 and path[0] in ("hyper_parameters", "datamodule_hyper_parameters"):
        owner = "LightningDataModule" if path[0].startswith("datamodule") else "LightningModule"
        fix = f"leave it out with self.save_hyperparameters(ignore=[{path[1]!r}]) in the {owner}'s __init__"
    else:
        fix = "make it picklable or leave it out of the checkpoint"
    return f"cannot save the checkpoint: {where} cannot be pickled ({reason}); {fix}."


def carried_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors with values among `obj`'s dicts, lists, tuples and modules (parameters and buffers), in the same
    order for a structure and for its copy loaded back."""
    if isinstance(obj, torch.Tensor):
        if not obj.is_meta:
            yield obj
    elif isinstance(obj, nn.Module):
        for module in obj.modules():
            yield from (t for t in [*module._parameters.values(), *module._buffers.values()]
                        if t is not None and not t.is_meta)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from carried_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from carried_tensors(value)


# -- pickling --------------------------------------------------------------------------------------------------


class _EmptyTensor:
    """Pickles as a new uninitialised tensor of `shape` and `dtype` (on the CPU); `parameter`: an nn.Parameter."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool, parameter: bool) -> None:
        self.shape, self.dtype, self.requires_grad, self.parameter = shape, dtype, requires_grad, parameter

    def __reduce__(self) -> tuple[Any, ...]:
        if self.parameter:
            return nn.Parameter, (_EmptyTensor(self.shape, self.dtype, False, False), self.requires_grad)
        return functools.partial(torch.empty, dtype=self.dtype), (self.shape,)


class _ModulesAsBuilt(pickle.Pickler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # one stand-in per parameter, so that pickle's memo ties again what was tied
        self._empty: dict[int, tuple[torch.Tensor, _EmptyTensor]] = {}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, nn.Module):
            # pickle's own way to rebuild an object of another class than its type (`__newobj__` refuses that)
            return copyreg._reconstructor, (_built_class(type(obj)), object, None), self._state(obj)  # type: ignore[attr-defined]
        return NotImplemented

    def _state(self, module: nn.Module) -> dict[str, Any]:
        state = {k: v for k, v in module.__dict__.items() if not k.startswith(_SHARDING_KEYS)}
        state["_parameters"] = {name: self._stand_in(p) for name, p in module._parameters.items()}
        state["_buffers"] = {name: self._stand_in(b) for name, b in module._buffers.items()}
        kept: set[int] = set()
        for key, hooks in module.__dict__.items():
            if key.endswith("hooks") and isinstance(hooks, dict):
                state[key] = type(hooks)((i, h) for i, h in hooks.items() if not _of_sharding(h))
                kept.update(state[key])
        for key in _HOOK_FLAGS:
            if key in state:
                state[key] = type(state[key])((i, flag) for i, flag in state[key].items() if i in kept)
        return state

    def _stand_in(self, tensor: torch.Tensor | None) -> Any:
        # A DTensor holds one rank's rows; a meta tensor (a module rebuilt by `consolidate`) none: either is written
        # as its full shape. Trained parameters come back as fp32, the weights' dtype in zoff's state dict.
        if tensor is None or not (isinstance(tensor, DTensor) or tensor.is_meta):
            return tensor
        if id(tensor) not in self._empty:
            parameter = isinstance(tensor, nn.Parameter)
            trained = parameter and tensor.requires_grad and tensor.is_floating_point()
            dtype = torch.float32 if trained else tensor.dtype
            stand_in = _EmptyTensor(tuple(tensor.shape), dtype, tensor.requires_grad, parameter)
            self._empty[id(tensor)] = (tensor, stand_in)  # the tensor too: its id stays its own while pickling
        return self._empty[id(tensor)][1]


class _PickleModule:
    """What `torch.save(pickle_module=...)` uses of a pickle module: its Pickler."""

    Pickler = _ModulesAsBuilt


def _built_class(cls: type) -> type:
    """The class the user built: the base of the class `fully_shard` generated."""
    if issubclass(cls, FSDPModule):
        return next(base for base in cls.__bases__ if not issubclass(base, FSDPModule))
    return cls


def _of_sharding(hook: Any) -> bool:
    fn = getattr(hook, "hook", hook)  # a load_state_dict pre-hook is wrapped
    fn = getattr(fn, "func", fn)  # functools.partial
    return getattr(fn, "__module__", None) is not None and fn.__module__.startswith(_SHARDING_CODE)


# -- the check -------------------------------------------------------------------------------------------------


class _Nowhere:
    def write(self, data: bytes) -> int:
        return len(data)


class _DryRun(_ModulesAsBuilt):
    @override
    def persistent_id(self, obj: Any) -> Any:
        # a storage (a tensor's bytes) is written apart from the pickle: only its place in it is checked
        return 0 if isinstance(obj, (torch.UntypedStorage, torch.storage.TypedStorage)) else None


def _dry_run(obj: Any) -> None:
    _DryRun(_Nowhere(), protocol=2).dump(obj)


def _culprit(obj: dict[str, Any], err: Exception) -> tuple[list[Any], Exception]:
    """The key of `obj`, and the key within it when it is a dict, whose value fails to pickle, and its error."""
    path: list[Any] = []
    while isinstance(obj, dict):
        for key, value in obj.items():
            try:
                _dry_run(value)
            except Exception as value_err:
                path.append(key)
                obj, err = value, value_err
                break
        else:
            break  # each value pickles alone: their combination fails (shared objects)
        if len(path) == 2:
            break
    return path, err
