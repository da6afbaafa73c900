"""bench.py's --activation-checkpointing: every run recomputes each block's activations in backward, the blocks being
zoff's default units (`repeated_blocks`: a GPT's `Block`, a Hugging Face model's decoder layer). zoff and Lightning's
FSDPStrategy take the block class as their own option; the other runs wrap the blocks in torch's non-reentrant
checkpoint wrapper (`recompute_blocks`), before any sharding, as torchtitan does for FSDP2. DeepSpeed's ZeRO-3 runs
build the model under zero.Init, which wraps every module's `__init__`: there the wrapper's own construction recurses
(its `__getattr__` reads the module it wraps before its `__init__` has set it), so their blocks keep their class and
have their forward checkpointed instead (`recompute_forwards`)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


@functools.cache
def block_class(family: type, kwargs: tuple[tuple[str, Any], ...]) -> type:
    """The class of the blocks of `family(**dict(kwargs))`, read from a copy built on the meta device (shapes only:
    a 7B model in a second or two)."""
    import torch

    from lightning_zoff.units import repeated_blocks

    with torch.device("meta"):
        module = family(**dict(kwargs))
    blocks = repeated_blocks(module)
    if not blocks:
        raise SystemExit(f"--activation-checkpointing: {family.__name__} has no repeated blocks to recompute")
    return type(blocks[0])


def recompute_blocks(module: Any, block: type | None) -> None:
    """Wrap every `block` of `module` in torch's non-reentrant checkpoint wrapper, in place (None: nothing)."""
    if block is None:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(module, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, block))


def recompute_forwards(module: Any, block: type[nn.Module] | None) -> None:
    """Checkpoint the forward of every `block` of `module` (torch's non-reentrant checkpoint), creating no module:
    the recompute of `recompute_blocks` for a model built under DeepSpeed's zero.Init. Each block's hooks (ZeRO-3's
    gathers) stay outside the checkpoint; its children's run again in the recompute, gathering what it needs."""
    if block is None:
        return
    for child in module.modules():
        if isinstance(child, block):  # the bound method wrapped on the instance: the block keeps its class
            child.forward = functools.partial(_checkpointed, child.forward)


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
