"""ZeRO-3 sharding of an unchanged model with FSDP2: one `fully_shard` per unit (`units.py` chooses them) under one
root."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_zoff._compat import (
    apply_to_tensors,
    checkpoint_activations_of,
    direct_tensors,
    hf_init_weights,
    init_as_root,
    is_view,
    recomputes_activations,
    replace_direct_tensor,
    set_recompute,
)
from lightning_zoff.units import Unit

# the attribute of each FSDP2 unit's modules that says how shard_model sharded them: keep_gathered restores it
RESHARDS_AFTER_FORWARD = "_zoff_reshard_after_forward"
# set on each FSDP2 unit's modules within keep_gathered: a no-grad forward leaves the unit gathered
KEPT_BY_CALLER = "_zoff_kept_gathered"


def param_names(module: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter, by id (tied parameters have several; the first is the one checkpoints use)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def padded_shard_numel(global_shape: torch.Size, world_size: int) -> int:
    """Elements of a parameter's shard as FSDP2 pads it in a unit's flat reduced gradient: ceil(dim0 / world) rows."""
    rows = math.ceil(global_shape[0] / world_size) if len(global_shape) else 1
    return rows * math.prod(global_shape[1:])


def local_chunk(full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """This rank's dim-0 shard of `full`, as FSDP2 cuts it (torch.chunk; trailing ranks may get nothing)."""
    chunks = torch.chunk(full, world_size, dim=0) if full.dim() else (full.reshape(1),)
    return chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))


def shard_model(
    model: nn.Module,
    units: list[Unit],
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    init_fn: ParamInitFn | None = None,
    reshard_after_forward: bool = True,
) -> dict[int, torch.Tensor]:
    """Shard `model` in place, one unit at a time, and return this rank's fp32 master shards, keyed by id of the
    sharded parameter.

    The masters are cut from the fp32 weights before the parameters are cast to `param_dtype`, so the master
    keeps every bit and the accelerator holds only `param_dtype` shards. Parameters still on the meta device (a
    model built under `trainer.init_module(empty_init=True)`) are materialised and initialised here, a unit at a
    time (`init_fn`, default `default_param_init(model)`; see `materialize`): no rank ever holds more than one
    unit in full.
    """
    world_size, rank = mesh.size(), mesh.get_local_rank()
    init_fn = init_fn or default_param_init(model)
    policy = inputs_in(param_dtype, mesh.device_type)
    masters: dict[str, torch.Tensor] = {}
    for unit in units:  # inner units first: a unit's own parameters are those no earlier unit took
        materialize(model, init_fn, under=unit.modules)  # the inner units are real already; this takes what is left
        with torch.no_grad():  # looked up again: materialising replaced the parameter objects
            for name, p in owned_params(model, unit, masters):
                masters[name] = local_chunk(p.detach(), world_size, rank).to(torch.float32, copy=True)
                p.data = p.data.to(param_dtype)
        for module in unit.modules:
            module.register_forward_hook(_output_not_a_view)  # runs before the hook fully_shard adds
        modules = list(unit.modules) if len(unit.modules) > 1 else unit.module
        fully_shard(modules, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        for module in unit.modules:
            setattr(module, RESHARDS_AFTER_FORWARD, reshard_after_forward)
            if not reshard_after_forward:  # after FSDP2's own post-forward hook
                module.register_forward_hook(_given_up_after_a_no_grad_forward)
    materialize(model, init_fn)  # buffers of modules outside every unit
    share_one_root(model, mesh)
    sharded = dict(model.named_parameters())
    for name, master in masters.items():
        local = cast(DTensor, sharded[name]).to_local()
        if local.shape != master.shape:
            raise RuntimeError(f"zoff: shard of {name} is {tuple(local.shape)}, expected"
                               f" {tuple(master.shape)}; FSDP2 sharded it differently than dim-0 chunks.")
    return {id(sharded[name]): master for name, master in masters.items()}


def share_one_root(model: nn.Module, mesh: DeviceMesh) -> None:
    """Make every unit of `model` part of one FSDP2 root: one context (streams, the end-of-backward callback) for all.

    FSDP2 makes its root the first unit to run a forward, which breaks when no one unit lies above the others: a
    group of tied modules cannot be a root, and units side by side would each be one, with streams of their own. The
    root's own forward need not run (the Trainer calls `training_step`), so it is a parameterless module above
    `model`, outside the model's tree, initialised here as FSDP2 initialises a root at its first forward."""
    root = nn.Module()
    root.add_module("model", model)  # the model does not know its parent: nothing changes in its tree
    fully_shard(root, mesh=mesh)
    init_as_root(root)


def inputs_in(param_dtype: torch.dtype, device_type: str = "cpu") -> MixedPrecisionPolicy:
    """FSDP2's policy for units whose parameters are already in `param_dtype`: nothing to cast but their floating-point
    inputs, when 16-bit.

    The shards hold no fp32 copy, so an op that autocast does not cast runs with 16-bit weights; an fp32 input (a
    batch of fp32 features, a residual stream kept in fp32 outside the model) would meet them there. CPU autocast
    leaves `layer_norm` alone and refuses an fp32 input with bf16 weights ("mixed dtype (CPU)"); CUDA autocast runs
    it in fp32. Cast at each unit's entry on CPU, every op inside sees the dtype of the weights, as FSDP2 arranges for
    a model whose parameters it casts itself; on GPUs inputs stay as the model made them."""
    sixteen_bit = param_dtype != torch.float32 and device_type == "cpu"
    return MixedPrecisionPolicy(param_dtype=param_dtype if sixteen_bit else None, cast_forward_inputs=sixteen_bit)


def _given_up_after_a_no_grad_forward(module: nn.Module, args: Any, output: Any) -> None:
    """With reshard_after_forward=False a unit stays gathered until its backward gives the parameters up; a forward
    without grad (validation, predict) has no backward, so the unit gives them up here, as FSDP2 does by default:
    the engine's updates go to the shards, and a unit left gathered would serve the old weights and its unsharded
    parameters in place of the shards (unless `keep_gathered` keeps it so)."""
    if not torch.is_grad_enabled() and not getattr(module, KEPT_BY_CALLER, False):
        cast(FSDPModule, module).reshard()


def _output_not_a_view(module: nn.Module, args: Any, output: Any) -> Any:
    """A unit's output that is a view, as a tensor of its own (a copy); None (the output as it is) otherwise.

    FSDP2 hooks each tensor a unit returns, to all-gather the unit's parameters again before its backward. An in-place
    op on a view (`logits += mask`) moves that view onto a new autograd node, so the hook would never run and backward
    would read freed parameters. torch's `nn.Linear` with a bias returns such a view for a 3-d input (its 2-d matmul
    result reshaped): a head at the top of a model is one, and FSDP2 warns about it on every rank. The copy costs one
    pass over that output, and no memory kept: unless backward needs it, the view's base goes with the view."""
    if torch.is_grad_enabled() and _holds_a_view(output):
        return apply_to_tensors(lambda t: t.clone() if t.requires_grad and is_view(t) else t, output)
    return None


def _holds_a_view(output: Any) -> bool:
    if isinstance(output, torch.Tensor):
        return output.requires_grad and is_view(output)
    if isinstance(output, dict):
        return any(_holds_a_view(v) for v in output.values())
    if isinstance(output, (list, tuple)):
        return any(_holds_a_view(v) for v in output)
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return any(_holds_a_view(getattr(output, f.name)) for f in dataclasses.fields(output))
    return False


def owned_params(model: nn.Module, unit: Unit, taken: Container[str]) -> list[tuple[str, nn.Parameter]]:
    """The parameters `unit` owns, by name: those it holds that no earlier unit (`taken`, names) took."""
    return [(name, p) for name, p in model.named_parameters() if unit.holds(name) and name not in taken]


ParamInitFn = Callable[[nn.Module], None]


def default_param_init(root: nn.Module) -> ParamInitFn:
    """How a module materialised from the meta device gets its initial values, by the first that applies:
    `root.init_module_weights(module)` when the LightningModule (`root`) defines it; for a module of a Hugging Face
    model, `_init_weights` of the innermost `PreTrainedModel` holding it (as transformers itself initialises a
    model built on meta: weights by the model's scheme, and buffers such as the rotary `inv_freq` recomputed);
    else the module's own `reset_parameters()`."""
    hook = getattr(root, "init_module_weights", None)
    if callable(hook):
        return hook
    hf_owner = _hf_owners(root)

    def init(module: nn.Module) -> None:
        owner = hf_owner.get(module)
        if owner is not None:
            hf_init_weights(owner, module)
            return
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise TypeError(
                f"zoff: {type(module).__name__} was built on the meta device (empty_init=True) and zoff does not know"
                " how to initialise it: it has no reset_parameters(). Define `init_module_weights(self, module)` on"
                " the LightningModule, pass ZoffStrategy(param_init_fn=...), or build the model without empty_init."
            )
        integer_buffers = [b for b in module.buffers(recurse=False) if not b.is_floating_point()]
        if integer_buffers and not type(module).__module__.startswith("torch."):
            # torch's own modules reset theirs there (BatchNorm's batch count); another's may come from __init__, gone
            # on meta, and unlike a floating-point one (NaN until written, checked in `materialize`) an integer
            # buffer left unset cannot be told apart
            raise TypeError(
                f"zoff: {type(module).__name__} was built on the meta device (empty_init=True) and holds integer"
                " buffers its reset_parameters() may not recompute. Define `init_module_weights(self, module)` on the"
                " LightningModule to set them, or build the model without empty_init."
            )
        reset()

    return init


def _hf_owners(root: nn.Module) -> dict[nn.Module, nn.Module]:
    """Each module under a transformers `PreTrainedModel`, mapped to the innermost one (whose `_init_weights`
    transformers applies to it)."""
    transformers = sys.modules.get("transformers")  # no model can be a PreTrainedModel unless it was imported
    if transformers is None:
        return {}
    owners: dict[nn.Module, nn.Module] = {}

    def walk(module: nn.Module, owner: nn.Module | None) -> None:
        if isinstance(module, transformers.PreTrainedModel):
            owner = module
        if owner is not None:
            owners[module] = owner
        for child in module.children():
            walk(child, owner)

    walk(root, None)
    return owners


def materialize(root: nn.Module, init_fn: ParamInitFn, under: Sequence[nn.Module] | None = None) -> None:
    """Give every meta-device parameter and buffer under `root` (or only under the modules `under`, a unit's: all of
    them at once, as they may share a parameter) memory on the CPU (in its own dtype) and its initial values:
    `init_fn(module)` for each module holding one directly, in module order.

    A parameter held by several modules (tied weights) becomes one new parameter in all of them. Floating-point
    memory starts as NaN, so a tensor that `init_fn` did not write is named instead of training from garbage.
    """
    inside = None if under is None else {id(m) for top in under for m in top.modules()}
    modules = [m for m in root.modules() if (inside is None or id(m) in inside)
               and any(t.is_meta for t in _direct_tensors(m))]
    if not modules:
        return
    replaced: dict[int, torch.Tensor] = {}
    made: list[tuple[nn.Module, str]] = []  # where each new tensor went (init may put another in its place)
    for module in modules:
        for kind, name, tensor in direct_tensors(module):
            if not tensor.is_meta:
                continue
            if id(tensor) not in replaced:
                real = torch.empty_like(tensor, device="cpu")
                if real.is_floating_point():
                    real.fill_(float("nan"))
                replaced[id(tensor)] = nn.Parameter(real, tensor.requires_grad) if kind == "param" else real
            replace_direct_tensor(module, kind, name, replaced[id(tensor)])
            made.append((module, name))
    with torch.no_grad():
        for module in modules:
            init_fn(module)
    names = {id(m): name for name, m in root.named_modules()}
    for module, name in made:
        tensor = getattr(module, name)
        if tensor.is_floating_point() and tensor.isnan().any():
            where = ".".join(filter(None, [names.get(id(module), ""), name]))
            raise RuntimeError(
                f"zoff: {where} was built on the meta device and its initialisation"
                f" ({getattr(init_fn, '__qualname__', init_fn)}) left it unset; initialise every parameter and buffer"
                " of the module it is given (a buffer computed in __init__ is lost on the meta device: recompute it"
                " in reset_parameters(), or define `init_module_weights(self, module)` on the LightningModule)."
            )


def _direct_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for _, _, t in direct_tensors(module)]


def checkpoint_activations(model: nn.Module, classes: Iterable[type[nn.Module]], *, recompute: bool = True
                           ) -> list[nn.Module]:
    """Recompute the activations of every module of `classes` in backward (torch's composable checkpoint: hooks on
    the module itself, so the module tree, the parameter names and FSDP2's units stay as they are). `recompute` False:
    installed switched off, for `recompute_activations` to switch on later. The modules it is installed on (switched
    off, none where this torch cannot switch it)."""
    classes = tuple(classes)
    if not classes:
        return []
    targets = [m for m in model.modules() if isinstance(m, classes)]
    if not targets:
        raise ValueError(f"activation_checkpointing_policy={sorted(c.__name__ for c in classes)} matches no module of"
                         f" {type(model).__name__}; name classes the model uses (for a transformer, its block).")
    return [module for module in targets if checkpoint_activations_of(module, recompute=recompute)]


def checkpoint_first_blocks(units: Sequence[Unit], count: int) -> None:
    """Recompute the activations of the first `count` blocks (`units`' order: the model's, which forwards follow), so
    only those pay a second forward for the memory their activations free."""
    blocks = [unit.module for unit in units if unit.is_block]
    if count > len(blocks):
        raise ValueError(f"activation_checkpointing_policy={count}: the model has {len(blocks)} blocks; name at most"
                         f" that many, or 'auto'.")
    for block in blocks[:count]:
        checkpoint_activations_of(block)


def recompute_activations(modules: Sequence[nn.Module]) -> list[str]:
    """Switch on the recompute `checkpoint_activations` installed on `modules`; the names of the classes switched on
    (none when every one was on already)."""
    switched = sorted({_own_class(m).__name__ for m in modules if not recomputes_activations(m)})
    for module in modules:
        set_recompute(module, True)
    return switched


def _own_class(module: nn.Module) -> type[nn.Module]:
    """The model's class of `module`, not the subclass of it FSDP2 made the module's class when it sharded it."""
    return cast("type[nn.Module]", next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)))


def block_classes(units: Iterable[Unit]) -> set[type[nn.Module]]:
    """The classes of the units that are blocks: what "auto" recomputes."""
    return {type(unit.module) for unit in units if unit.is_block}


def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


@contextmanager
def keep_gathered(model: nn.Module) -> Iterator[None]:
    """Within this block every FSDP2 unit of `model` keeps its parameters gathered after its first forward, and gives
    them up at the end: generating a sequence then all-gathers each unit once, not once per token, and every rank
    holds the whole model's parameters meanwhile (as DDP does). Every rank must enter it, and run at least the first
    forward, together. Does nothing to a model that is not sharded."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        setattr(unit, KEPT_BY_CALLER, True)
    try:
        yield
    finally:
        for unit in units:  # as shard_model sharded it
            unit.set_reshard_after_forward(getattr(unit, RESHARDS_AFTER_FORWARD, True), recurse=False)
            setattr(unit, KEPT_BY_CALLER, False)
            unit.reshard()
