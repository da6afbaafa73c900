"""ZeRO-3 sharding of an unchanged model with FSDP2: one `fully_shard` per unit, chosen by a wrap policy."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The default policy: children of every `nn.ModuleList` whose children repeat one class (transformer blocks)."""
    blocks = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            blocks.extend(module)
    return blocks


def plan_units(model: nn.Module, wrap_policy: Iterable[type[nn.Module]] | None = None) -> list[tuple[str, nn.Module]]:
    """Units in the order they must be sharded (inner first): the blocks, then each top-level child of `model`
    that holds parameters outside the blocks (for a GPT: the embeddings, final norm and head)."""
    if wrap_policy:
        classes = tuple(wrap_policy)
        candidates = [m for m in model.modules() if isinstance(m, classes) and m is not model]
    else:
        candidates = repeated_blocks(model)
    names = {m: n for n, m in model.named_modules()}
    # keep the outermost: a block inside another block is covered by it
    chosen = set(candidates)
    blocks = [m for m in candidates if not any(a in chosen for a in _ancestors(model, m))]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    if any(True for _ in model.parameters(recurse=False)):
        raise ValueError(
            f"{type(model).__name__} holds parameters directly; zoff shards submodules, whose forward FSDP2 hooks."
            " Move these parameters into a submodule (for example `self.model = MyNet()`)."
        )
    roots = [(n, c) for n, c in model.named_children() if any(id(p) not in in_blocks for p in c.parameters())]
    return [(names[b], b) for b in blocks] + roots


def _ancestors(root: nn.Module, target: nn.Module) -> list[nn.Module]:
    for name, module in root.named_modules():
        if module is target:
            parts = name.split(".")
            return [root.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]
    return []


def local_chunk(full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """This rank's dim-0 shard of `full`, as FSDP2 cuts it (torch.chunk; trailing ranks may get nothing)."""
    chunks = torch.chunk(full, world_size, dim=0) if full.dim() else (full.reshape(1),)
    return chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))


def shard_model(
    model: nn.Module,
    units: list[tuple[str, nn.Module]],
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
) -> dict[int, torch.Tensor]:
    """Shard `model` in place, one unit at a time, and return this rank's fp32 master shards, keyed by id of the
    sharded parameter.

    The masters are cut from the fp32 weights before the parameters are cast to `param_dtype`, so the master
    keeps every bit and the accelerator holds only `param_dtype` shards. Parameters still on the meta device (a
    model built under `trainer.init_module(empty_init=True)`) are materialised and initialised here, a unit at a
    time (`reset_parameters()` of the modules holding them): no rank ever holds more than one unit in full.
    """
    world_size, rank = mesh.size(), mesh.get_local_rank()
    masters: dict[str, torch.Tensor] = {}
    for unit_name, unit in units:  # inner units first: a unit's own parameters are those no earlier unit took
        prefix = f"{unit_name}." if unit_name else ""
        _materialize(unit, {id(p) for _, p in _untaken(model, prefix, masters)})
        with torch.no_grad():  # looked up again: materialising replaced the parameter objects
            for name, p in _untaken(model, prefix, masters):
                masters[name] = local_chunk(p.detach(), world_size, rank).to(torch.float32, copy=True)
                p.data = p.data.to(param_dtype)
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    sharded = dict(model.named_parameters())
    for name, master in masters.items():
        if sharded[name].to_local().shape != master.shape:
            raise RuntimeError(f"zoff: shard of {name} is {tuple(sharded[name].to_local().shape)}, expected"
                               f" {tuple(master.shape)}; FSDP2 sharded it differently than dim-0 chunks.")
    return {id(sharded[name]): master for name, master in masters.items()}


def _untaken(model: nn.Module, prefix: str, taken: dict[str, torch.Tensor]) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if name.startswith(prefix) and name not in taken]


def _materialize(unit: nn.Module, param_ids: set[int]) -> None:
    """Give the meta-device parameters among `param_ids` real fp32 memory on the CPU and their initial values."""
    for module in unit.modules():
        direct = [p for p in module.parameters(recurse=False) if id(p) in param_ids]
        if not any(p.is_meta for p in direct):
            continue
        init = getattr(module, "reset_parameters", None)
        if not callable(init):
            raise TypeError(
                f"zoff: {type(module).__name__} was built on the meta device (empty_init=True) but has no"
                " reset_parameters() to initialise its parameters; add one, or build the model without empty_init."
            )
        module.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            init()


def checkpoint_activations(model: nn.Module, classes: Iterable[type[nn.Module]]) -> None:
    """Recompute the activations of every module of `classes` in backward (torch's composable checkpoint: hooks on
    the module itself, so the module tree, the parameter names and FSDP2's units stay as they are)."""
    classes = tuple(classes)
    if not classes:
        return
    from torch.distributed._composable import checkpoint

    targets = [m for m in model.modules() if isinstance(m, classes)]
    if not targets:
        raise ValueError(f"activation_checkpointing_policy={sorted(c.__name__ for c in classes)} matches no module of"
                         f" {type(model).__name__}; name classes the model uses (for a transformer, its block).")
    for module in targets:
        checkpoint(module)


def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())
