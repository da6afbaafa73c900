"""`fabric.save(path, state)` and `fabric.load(path, state)` in the Trainer's checkpoint layout, so that a checkpoint
written by either front door loads in the other: the module's weights under ``state_dict`` (by the module's own names),
the optimizer's state as ``optimizer_states[0]``, the loss scale under the Trainer's precision plugin's name, and every
other entry of Fabric's `state` under its own key. A `"full"` file holds the weights and the optimizer's state under
their keys in `state` too (``{"model": ...}``, as Fabric's FSDP writes it). `fabric.load_raw(path, model)` loads whole
weights (`load_raw`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.fabric.utilities.types import _Stateful
from torch import nn

from lightning_zoff.checkpoint.files import is_zoff_checkpoint
from lightning_zoff.contract import Core
from lightning_zoff.precision_math import PrecisionMath

# Where the Trainer keeps the loss scale: its precision plugin's class name (`ZoffPrecision.state_dict`).
PRECISION_KEY = "ZoffPrecision"
# The keys the layout itself uses; an entry of Fabric's `state` may not take one.
RESERVED = ("state_dict", "optimizer_states", "lr_schedulers", "zoff", PRECISION_KEY, "pytorch-lightning_version")


def split_state(state: dict[str, Any], module: nn.Module) -> tuple[str | None, str | None, dict[str, Any]]:
    """The keys of the set-up module and of an optimizer in `state`, and the other entries. Refuses another module,
    several optimizers, or an entry under a key the layout uses."""
    module_key, optimizer_key, rest = None, None, {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            if value is not module:
                raise ValueError(f"fabric.save/load under strategy='zoff': state[{key!r}] is not the module set up"
                                 " with fabric.setup(model, optimizer); zoff saves and loads that one.")
            module_key = key
        elif isinstance(value, torch.optim.Optimizer):
            if optimizer_key is not None:
                raise ValueError("strategy='zoff' drives exactly one optimizer; the state holds several.")
            optimizer_key = key
        elif key in RESERVED:
            raise ValueError(f"fabric.save/load under strategy='zoff': {key!r} names a part of the checkpoint's own"
                             f" layout ({', '.join(RESERVED)}); keep that entry under another key.")
        else:
            rest[key] = value
    return module_key, optimizer_key, rest


def save(training: Core, precision: PrecisionMath, path: Any, state: dict[str, Any]) -> None:
    module = training.module
    assert module is not None, "fabric.save: set up the model first (fabric.setup(model, optimizer))"
    module_key, optimizer_key, rest = split_state(state, module)
    checkpoint = {key: value.state_dict() if isinstance(value, _Stateful) else value for key, value in rest.items()}
    checkpoint["state_dict"] = training.state_dict()
    if optimizer_key is not None:
        checkpoint["optimizer_states"] = [training.optimizer_state(state[optimizer_key])]
    if training.config.state_dict_type == "full":
        # also under the state's own keys, as Fabric's FSDP writes its one file (`torch.load(path)["model"]`, what
        # LitGPT's tools read); torch.save stores each tensor once, whichever keys hold it
        if module_key is not None:
            checkpoint[module_key] = checkpoint["state_dict"]
        if optimizer_key is not None:
            checkpoint[optimizer_key] = checkpoint["optimizer_states"][0]
    checkpoint["lr_schedulers"] = []  # a Fabric loop keeps its scheduler as an entry of its own; the Trainer needs one
    checkpoint[PRECISION_KEY] = precision.state_dict()
    checkpoint["pytorch-lightning_version"] = lightning.__version__  # the Trainer migrates checkpoints by it
    training.save(checkpoint, path)


def load(training: Core, precision: PrecisionMath, path: Any, state: dict[str, Any], strict: bool,
         weights_only: bool | None) -> dict[str, Any]:
    """Restore the module and the optimizer in place and the other entries of `state` from the checkpoint; what the
    checkpoint holds besides, as Fabric's `load` returns it."""
    module = training.module
    assert module is not None, "fabric.load: set up the model first (fabric.setup(model, optimizer))"
    module_key, optimizer_key, rest = split_state(state, module)
    optimizer = state[optimizer_key] if optimizer_key is not None else None
    checkpoint = training.load(path, optimizer, weights_only)
    for alias in (module_key, optimizer_key):  # a full file's copies under the state's own keys (`save`)
        if alias is not None:
            checkpoint.pop(alias, None)
    if optimizer is not None and "optimizer_states" not in checkpoint and strict:
        raise KeyError(f"{path}: holds no optimizer state (saved without an optimizer); pass strict=False to load the"
                       " weights alone.")
    missing = [key for key in rest if key not in checkpoint]
    if missing and strict:
        raise KeyError(f"{path}: holds no {missing}; the checkpoint holds {sorted(checkpoint)}. Pass strict=False to"
                       " load what it holds.")
    precision.load_state_dict(checkpoint.get(PRECISION_KEY, {}))
    for key, value in rest.items():
        if key not in checkpoint:
            continue
        if isinstance(value, _Stateful):
            value.load_state_dict(checkpoint.pop(key))
        else:
            state[key] = checkpoint.pop(key)
    return {key: value for key, value in checkpoint.items() if key not in RESERVED}


def load_raw(training: Core, path: Any, strict: bool) -> None:
    """`fabric.load_raw(path, model)`: a zoff checkpoint's weights, or whole weights as a `state_dict` file (plain, or
    Fabric's `{"model": ...}`), a .safetensors file or a Hugging Face directory (`Checkpoints.load_full_state_dict`),
    each rank reading its own rows."""
    if is_zoff_checkpoint(Path(path)):
        training.load(path, None)
        return
    training.load_full_state_dict(path, strict=strict)
