"""Every private name of torch and transformers that zoff's core uses, in one place, so an upgrade that moves one
breaks here (and in tests/test_compat.py), not somewhere in the data path. Lightning's private names, which only the
two front doors use, are in `_compat_lightning`. Checked on torch 2.11 (GPU machine) and torch 2.13 (CPU)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.utils import _apply_to_tensors
from torch.utils._python_dispatch import TorchDispatchMode as DispatchMode

__all__ = [
    "DispatchMode", "all_gather_streams", "apply_to_tensors", "before_reduce", "checkpoint_activations_of",
    "dcp_data_extents", "direct_tensors", "fake_tensor_mode", "fsdp_param_group", "fused_adam_step", "hf_init_weights",
    "init_as_root", "is_view", "recomputes_activations", "replace_direct_tensor", "restore_post_backward",
    "set_recompute", "unit_modules", "unit_params",
]


# -- torch ------------------------------------------------------------------------------------------------------

def direct_tensors(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """`(kind, name, tensor)` of each parameter (kind "param") and buffer ("buffer") `module` itself holds, not its
    children's."""
    params = [("param", n, p) for n, p in module._parameters.items() if p is not None]
    return params + [("buffer", n, b) for n, b in module._buffers.items() if b is not None]


def replace_direct_tensor(module: nn.Module, kind: str, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in the place of `module`'s own parameter or buffer `name` (`kind` as `direct_tensors` says), as
    it is: a buffer stays persistent or not, and no attribute logic of the module's class runs."""
    (module._parameters if kind == "param" else module._buffers)[name] = tensor  # type: ignore[assignment]


def checkpoint_activations_of(module: nn.Module, *, recompute: bool = True) -> bool:
    """torch's composable activation checkpointing on `module`: hooks on the module itself, no wrapper. `recompute`
    False installs it switched off (`set_recompute` switches it on later); whether it was installed: not switched off
    where this torch has no switch (it would recompute from the start, and cost what "auto" did not choose)."""
    from torch.distributed._composable import checkpoint  # imported on use, as only that option needs it

    if not recompute and not _checkpoint_has_switch():
        return False
    checkpoint(module)
    set_recompute(module, recompute)
    return True


def set_recompute(module: nn.Module, on: bool) -> None:
    """Switch the activation checkpointing `checkpoint_activations_of` installed on `module` on or off. Its hooks read
    the flag at each forward (torch 2.11 to 2.13 alike), so switched off they only read it: nothing else changes."""
    from torch.distributed._composable import checkpoint

    checkpoint.state(module).enable_hook = on


def recomputes_activations(module: nn.Module) -> bool:
    """Whether `module`'s activations are recomputed in backward: torch's composable checkpointing is on it, switched
    on (torch switches it off itself while it recomputes)."""
    from torch.distributed._composable import checkpoint

    return bool(getattr(checkpoint.state(module), "enable_hook", False))


def _checkpoint_has_switch() -> bool:
    from torch.distributed._composable import checkpoint_activation

    return hasattr(getattr(checkpoint_activation, "_CheckpointState", None), "enable_hook")


def dcp_data_extents(metadata: Any) -> dict[str, int]:
    """For each data file of a torch.distributed.checkpoint directory, how many bytes its index (`metadata`, as
    `FileSystemReader.read_metadata` returns it) needs it to hold."""
    needed: dict[str, int] = {}
    for item in getattr(metadata, "storage_data", {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    return needed


def is_view(tensor: torch.Tensor) -> bool:
    """Whether autograd tracks `tensor` as a view of another tensor (its base)."""
    return tensor._base is not None


def apply_to_tensors(fn: Callable[[torch.Tensor], torch.Tensor], output: Any) -> Any:
    """`output` with `fn` applied to each tensor in it, through tuples, lists, dicts and dataclasses (rebuilt): the
    traversal FSDP2 itself casts a unit's output with."""
    return _apply_to_tensors(fn, output)


def fake_tensor_mode() -> Any:
    """torch's fake tensor mode: ops inside it make tensors of the right shape, dtype and device, with no data and no
    memory (what torch.compile traces with). `DispatchMode` is the base class of a mode that sees every op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def flop_formulas() -> dict[Any, Callable[..., int]]:
    """torch's FLOP formulas by op (what `torch.utils.flop_counter.FlopCounterMode` sums): each takes the op's
    arguments and `out_val`, and reads only shapes."""
    from torch.utils.flop_counter import flop_registry

    return flop_registry


def fused_adam_step(decoupled: bool) -> Callable[..., None]:
    """torch's fused multi-tensor Adam (`decoupled`: AdamW) kernel, the one `torch.optim.AdamW(fused=True)` runs."""
    return torch._fused_adamw_ if decoupled else torch._fused_adam_


# -- transformers -------------------------------------------------------------------------------------------------

def hf_init_weights(owner: nn.Module, module: nn.Module) -> None:
    """Initialise `module` the way its Hugging Face `PreTrainedModel` `owner` does when it builds a model."""
    owner._init_weights(module)  # type: ignore[operator]


# -- FSDP2 --------------------------------------------------------------------------------------------------------

def init_as_root(module: nn.Module) -> None:
    """FSDP2's lazy initialisation of the `fully_shard`ed `module` as the root of every unit under it: what FSDP2 runs
    at its root's first forward (the units share its context from then on; none becomes a root of its own)."""
    module._get_fsdp_state()._lazy_init()  # type: ignore[operator]


def unit_modules(module: nn.Module) -> tuple[nn.Module, ...]:
    """Every module of the unit `module` belongs to: itself, or the modules `fully_shard([a, b])` grouped with it."""
    return tuple(module._get_fsdp_state()._modules)  # type: ignore[operator]


def fsdp_param_group(module: nn.Module) -> Any:
    """FSDP2's parameter group of the unit `module` (None when it manages no parameter). torch 2.13 keeps a list of
    groups and a compatibility property that asserts there is at most one; zoff makes one group per unit."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        if len(groups) > 1:
            raise RuntimeError(f"zoff: an FSDP2 unit with {len(groups)} parameter groups; zoff shards one per unit")
        return groups[0] if groups else None
    return state._fsdp_param_group


def unit_params(module: nn.Module) -> list[nn.Parameter]:
    """The sharded parameters of the unit `module`, in the order FSDP2 lays out its flat reduced gradient."""
    group = fsdp_param_group(module)
    return [] if group is None else [fp.sharded_param for fp in group.fsdp_params]


def all_gather_streams(module: nn.Module) -> list[torch.Stream] | None:
    """The streams FSDP2 all-gathers the unit's parameters on, or None if this torch keeps them elsewhere."""
    comm = getattr(module._get_fsdp_state(), "_comm_ctx", None)  # type: ignore[operator]
    streams = [getattr(comm, name, None) for name in ("all_gather_copy_in_stream", "all_gather_stream")]
    return None if any(s is None for s in streams) else cast("list[torch.Stream]", streams)


def before_reduce(module: nn.Module, report: Callable[[list[bool]], None]) -> None:
    """Run `report(used)` each time FSDP2 is about to reduce-scatter the unit's gradients, `used` saying for each
    parameter that requires a gradient (in FSDP2's order) whether it got one in this backward; and give each that got
    none a zero gradient first, so the reduced flat shard always holds every trainable parameter (the same tensors on
    every rank: a branch, an adapter or an MoE expert unused on one rank but used on another).

    torch >= 2.13 can zero-fill by itself (`set_reduce_scatter_unused_params`) but tells no one which parameters had
    no gradient, and torch 2.11 has neither: so zoff wraps the group's `post_backward`, which FSDP2 calls through the
    instance both from autograd and from its end-of-backward callback. A unit none of whose parameters got a gradient
    did not take part in this backward: it is left alone (no reduce, as FSDP2 does)."""
    group = fsdp_param_group(module)
    if group is None:
        return
    post_backward = type(group).post_backward.__get__(group)  # the class's, so wrapping twice wraps once

    def wrapped(*args: Any) -> Any:
        trainable = [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad]
        used = [_has_unsharded_grad(fp) for fp in trainable]
        if any(used):
            for fp, has_grad in zip(trainable, used, strict=True):
                if not has_grad:
                    fp.unsharded_param.grad = torch.zeros_like(fp.unsharded_param)
            report(used)
        return post_backward(*args)

    group.post_backward = wrapped


def _has_unsharded_grad(fsdp_param: Any) -> bool:
    if not hasattr(fsdp_param, "_unsharded_param"):  # never all-gathered: not used yet
        return False
    return fsdp_param.unsharded_param.grad is not None or fsdp_param.unsharded_accumulated_grad is not None


def restore_post_backward(module: nn.Module) -> None:
    """Undo `before_reduce` (the engine that installed it is closing)."""
    group = fsdp_param_group(module)
    if group is not None and "post_backward" in vars(group):
        del group.post_backward


def expandable_cuda_segments() -> bool:
    """Have torch's CUDA allocator grow its segments in place (`expandable_segments`) unless the user configured the
    allocator: units' gradients and all-gathers of many sizes otherwise fragment it, and "auto" places state by the
    memory it reserved. Whether it was set."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return False
    # torch >= 2.10 names the setter per accelerator (the CUDA one warns that it is deprecated there)
    set_settings = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                    or getattr(torch.cuda.memory, "_set_allocator_settings", None))
    if set_settings is None:
        return False
    set_settings("expandable_segments:True")
    return True


def finish_failed_backward(module: nn.Module) -> None:
    """After a forward or backward that raised: every unit idle and resharded, and FSDP2's record of the step (the
    forward's root, the order backward prefetches in, all-gathers not yet waited for) forgotten, so the next forward
    starts as after a finished step. A backward's end-of-backward callback that never ran runs (pending reductions
    done); a forward that never reached its end gets the same callback, which finishes every unit as a backward would
    (nothing to reduce: no gradient exists). torch 2.13's `FSDPModule.reset_iter_state` does this too, but 2.11 has
    none: one path for both, the one the CPU tests run."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if units:
        state = units[0]._get_fsdp_state()  # every unit shares the root's context (`sharding.share_one_root`)
        context = state._state_ctx
        forward_failed = context.iter_forward_root is not None
        if forward_failed:
            for unit_state in context.all_states:  # modules of a group the failed forward did not reach: no warning
                getattr(unit_state, "_modules_to_run_forward", set()).clear()
        if context.post_backward_final_callback_queued or forward_failed:
            state._root_post_backward_final_callback()
        context.iter_forward_root = None  # else the next forward skips its root's pre-forward (streams' waits)
        _free_last_all_gather(state)
    for unit in units:
        unit.reshard()


def _free_last_all_gather(state: Any) -> None:
    """The all-gather FSDP2 keeps until the forward's root ends (its memory is freed once the streams pass it)."""
    comm = state._comm_ctx
    gathered = getattr(comm, "all_gather_state", None)
    if gathered is None:
        return
    if gathered.event is not None:
        for stream in (comm.all_gather_copy_in_stream, comm.all_gather_stream):
            stream.wait_event(gathered.event)
    comm.all_gather_state = None
