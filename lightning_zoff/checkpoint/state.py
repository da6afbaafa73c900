"""What a checkpoint holds, by the LightningModule's own parameter names: the engine's fp32 master weights and
optimizer moments, either as sharded views (DTensors over this rank's rows where they live, on the host or the
accelerator, which a load fills in place at any world size) or gathered whole; and the restore of the rest (step
counts, param groups, the model's 16-bit shards).

Optimizer state follows torch's layout keyed by name: ``{"state": {name: {"exp_avg", "exp_avg_sq", "step"}},
"param_groups": [{..., "params": [names]}]}``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_zoff.checkpoint.pretrained import OnDisk
from lightning_zoff.offload import OffloadEngine, ParamState
from lightning_zoff.sharding import local_chunk, padded_shard_numel, param_names

# torch 2.13 renamed all_gather_into_tensor (2.11 has only the old name)
_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass(frozen=True)
class ParamEntry:
    name: str  # the first of its names; tied parameters have several
    state: ParamState  # the engine's view of this rank's state of the parameter

    @property
    def trained(self) -> bool:
        """Whether the optimizer trains it; if not (frozen, or outside the optimizer) its value is the accelerator's."""
        return self.state.master is not None

    @property
    def rows(self) -> torch.Tensor:
        """This rank's rows of the parameter where they live: the fp32 master when trained (on the host or the
        accelerator), else the model's own 16-bit shard."""
        return self.state.master if self.state.master is not None else self.state.local.detach()


def param_entries(module: nn.Module, engine: OffloadEngine) -> Iterator[tuple[list[str], ParamEntry]]:
    names = param_names(module)
    for state in engine.param_states():
        all_names = names[id(state.param)]
        yield all_names, ParamEntry(all_names[0], state)


class StateMeshes:
    """1-D meshes over all ranks, one for each device type the state lives on (the host, the accelerator or both):
    a DTensor's local rows must be on its mesh's device type, or DTensor copies them there."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._meshes: dict[str, DeviceMesh] = {}

    def __call__(self, device: torch.device) -> DeviceMesh:
        if device.type not in self._meshes:
            self._meshes[device.type] = init_device_mesh(device.type, (self.world_size,))
        return self._meshes[device.type]


def _sharded(local: torch.Tensor, param: nn.Parameter, meshes: StateMeshes) -> DTensor:
    # FSDP2 and DTensor cut dim 0 alike (torch.chunk), so this rank's rows are its Shard(0) of the global tensor
    return DTensor.from_local(local, meshes(local.device), [Shard(0)], run_check=False, shape=param.shape,
                              stride=param.stride())


def sharded_model_state(module: nn.Module, engine: OffloadEngine, meshes: StateMeshes) -> dict[str, torch.Tensor]:
    """The module's state dict: each parameter a DTensor over this rank's rows where they live (`ParamEntry.rows`),
    buffers as they are. Loading into it restores the state in place."""
    params: dict[str, torch.Tensor] = {}
    for names, entry in param_entries(module, engine):
        tensor = _sharded(entry.rows, entry.state.param, meshes)
        params.update((name, tensor) for name in names)
    return _with_buffers(module, params)


def sharded_optimizer_state(
    module: nn.Module, engine: OffloadEngine, optimizer: torch.optim.Optimizer, meshes: StateMeshes
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for _, entry in param_entries(module, engine):
        if entry.trained:
            state[entry.name] = {key: _sharded(rows, entry.state.param, meshes)
                                 for key, rows in entry.state.moments.items()}
            state[entry.name]["step"] = torch.tensor(entry.state.step, dtype=torch.int64)
    return {"state": state, "param_groups": named_param_groups(module, optimizer)}


def named_param_groups(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    names = param_names(module)
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)][0] for p in g["params"]]}
            for g in optimizer.param_groups]


def _with_buffers(module: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # the module's own key order; buffers are replicated (FSDP2 does not shard them)
    return {key: params[key] if key in params else value.detach() for key, value in module.state_dict().items()}


def _gathered_param(rows: torch.Tensor, param: nn.Parameter, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """A parameter's global tensor in `dtype` on the host from every rank's rows, wherever they live (padded to the
    same count on every rank, as FSDP2 does)."""
    padded = padded_shard_numel(param.shape, world_size)
    local = torch.zeros(padded, dtype=dtype)
    local[: rows.numel()] = rows.reshape(-1)
    gathered = torch.empty(world_size * padded, dtype=dtype)
    if world_size > 1:
        _all_gather_flat(gathered, local)
    else:
        gathered.copy_(local)
    shape = param.shape
    whole = gathered.view(world_size, padded).reshape(-1, *shape[1:])
    return whole[: shape[0]].reshape(shape).clone() if len(shape) else whole.reshape(()).clone()


def full_state_dict(module: nn.Module, engine: OffloadEngine) -> dict[str, torch.Tensor]:
    """The module's state dict with every parameter whole in fp32 on the CPU (the master where trained). A
    collective: every rank calls it and gets the whole dict."""
    params: dict[str, torch.Tensor] = {}
    for names, entry in param_entries(module, engine):
        tensor = _gathered_param(entry.rows, entry.state.param, engine.world_size, torch.float32)
        params.update((name, tensor) for name in names)
    return _with_buffers(module, params)


def full_optimizer_state(module: nn.Module, engine: OffloadEngine, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state with whole (gathered) moments, by parameter name. A collective."""
    state = {}
    for _, entry in param_entries(module, engine):
        if entry.trained:
            state[entry.name] = {key: _gathered_param(rows, entry.state.param, engine.world_size, rows.dtype)
                                 for key, rows in entry.state.moments.items()}
            state[entry.name]["step"] = torch.tensor(entry.state.step, dtype=torch.int64)
    return {"state": state, "param_groups": named_param_groups(module, optimizer)}


def unmatched_keys(module: nn.Module, targets: dict[str, Any], full: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Keys of `targets` that `full` lacks, and keys of `full` that `targets` lacks. A tied parameter is there when
    any of its names is (Hugging Face checkpoints keep one of them); `targets` holds it under each name as one
    tensor, so filling one name fills all."""
    aliases = {name: names for names in param_names(module).values() for name in names}
    missing = [k for k in targets.keys() - full.keys() if not any(a in full for a in aliases.get(k, ()))]
    return sorted(missing), sorted(full.keys() - targets.keys())


def mismatched_shapes(targets: dict[str, torch.Tensor], full: dict[str, Any]) -> list[str]:
    """`name: file shape != model shape` for each tensor of `full` whose whole shape differs from its target's."""
    wrong = []
    for key, target in targets.items():
        source = full[key]
        shape = tuple(source.shape if isinstance(source, torch.Tensor) else source.shape_on_disk())
        if shape != tuple(target.shape):
            wrong.append(f"{key}: {list(shape)} in the weights, {list(target.shape)} in the model")
    return wrong


def fill_from_full(targets: dict[str, Any], full: dict[str, Any], world_size: int, rank: int) -> None:
    """Copy this rank's rows of each whole tensor in `full` into the (sharded or plain) tensor at the same key of
    `targets`, recursing into dicts; the counterpart of a sharded load for a checkpoint saved whole. A tensor still
    on disk (`OnDisk`) is read here, only this rank's rows of it when sharded."""
    for key, target in targets.items():
        if isinstance(target, dict):
            fill_from_full(target, full[key], world_size, rank)
        elif isinstance(target, DTensor):
            source = full[key]
            on_disk = isinstance(source, OnDisk)
            rows = source.local_chunk(world_size, rank) if on_disk else local_chunk(source, world_size, rank)
            target.to_local().copy_(rows)
        elif isinstance(target, torch.Tensor):
            source = full[key]
            target.copy_(source.whole() if isinstance(source, OnDisk) else source)


@torch.no_grad()
def finish_restore(module: nn.Module, engine: OffloadEngine, optimizer: torch.optim.Optimizer | None,
                   optimizer_state: dict[str, Any] | None) -> None:
    """After the weights and the moments were loaded in place (into `sharded_model_state` and
    `sharded_optimizer_state`): restore step counts and param-group settings, then make the model's trained
    parameters the cast of their restored masters."""
    if optimizer is not None and optimizer_state is not None:
        _restore_steps(module, engine, optimizer_state["state"])
        _restore_param_groups(optimizer, optimizer_state["param_groups"])
    engine.send_masters()


def _restore_steps(module: nn.Module, engine: OffloadEngine, state: dict[str, Any]) -> None:
    engine.set_steps({entry.state.param: int(state[entry.name]["step"])
                      for _, entry in param_entries(module, engine) if entry.trained})


def _restore_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint has {len(saved)} optimizer param groups, configure_optimizers"
                         f" returned {len(optimizer.param_groups)}")
    for group, saved_group in zip(optimizer.param_groups, saved, strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def weight_targets(module: nn.Module) -> dict[str, torch.Tensor]:
    """Fresh fp32 tensors sharded like the module's parameters (and its buffers), to load weights into when there
    is no engine (validate/test/predict from a checkpoint)."""
    names = param_names(module)
    params: dict[str, torch.Tensor] = {}
    for p in module.parameters():
        target = torch.zeros_like(p.detach(), dtype=torch.float32)
        params.update((name, target) for name in names[id(p)])
    return _with_buffers(module, params)


@torch.no_grad()
def apply_weights(module: nn.Module, targets: dict[str, torch.Tensor], masters: dict[int, torch.Tensor]) -> None:
    """Copy loaded weights into the model's shards and into the fp32 masters (by id of the sharded parameter) that the
    engine of a later fit starts from. A parameter none of whose names `targets` holds keeps its value."""
    names = param_names(module)
    for p in module.parameters():
        loaded = next((targets[name] for name in names[id(p)] if name in targets), None)
        if loaded is None:
            continue
        local = loaded.to_local() if isinstance(loaded, DTensor) else loaded
        cast(DTensor, p).to_local().copy_(local)
        if id(p) in masters:
            masters[id(p)].copy_(local)
