"""Where the engine meets FSDP2: the hooks through which a unit's reduced gradient reaches it, and the gate that
holds a unit's forward until its updated shards are on the accelerator. The hooks hold the engine weakly, so a
model outliving its Trainer does not keep the engine (its thread and its host state) alive."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_zoff._compat import all_gather_streams, before_reduce, restore_post_backward


class UnitHooks:
    """One unit's hooks. `engine` is called back as `engine.on_grads_noted(unit_index, used)`,
    `engine.on_unit_reduced(unit_index, flat_grad)` and `engine.gate(unit_index)`."""

    def __init__(self, module: nn.Module, engine: Any, unit_index: int, copy_stream: torch.cuda.Stream | None) -> None:
        self.module = cast(FSDPModule, module)  # a unit: fully_shard made it one
        ref = weakref.ref(engine)

        def call(method: str) -> Callable[..., None]:
            def hook(*args: Any) -> None:
                target = ref()
                if target is None:
                    _refuse_backward()
                getattr(target, method)(unit_index, *args)
            return hook

        noted, reduced, gate = call("on_grads_noted"), call("on_unit_reduced"), call("gate")
        before_reduce(module, noted)
        self.module.set_gradient_divide_factor(1.0)
        self.module.set_force_sum_reduction_for_comms(True)  # gloo has no AVG; the 1/world goes into the step
        self.module.set_all_reduce_hook(reduced, stream=copy_stream)
        # prepend: before FSDP2's own pre-forward, whose all-gather reads the sharded parameters
        self._gate = module.register_forward_pre_hook(lambda *_: gate(), prepend=True)

    def remove(self) -> None:
        """FSDP2's reduce hook cannot be removed: it is pointed at one that refuses until the next engine's hooks
        replace it."""
        self._gate.remove()
        self.module.set_all_reduce_hook(lambda flat_grad: _refuse_backward())
        restore_post_backward(cast(nn.Module, self.module))


def order_after_copy(event: torch.cuda.Event | None, module: nn.Module, device: torch.device) -> None:
    """Make the unit's forward, and FSDP2's all-gather of its shards, wait for `event` (their host-to-device copy)."""
    if event is None:
        return
    torch.cuda.current_stream(device).wait_event(event)
    streams = all_gather_streams(module)
    if streams is None:
        event.synchronize()  # a torch whose FSDP2 keeps them elsewhere: wait on the host, always safe
    else:
        for stream in streams:
            stream.wait_event(event)


def _refuse_backward() -> None:
    raise RuntimeError("zoff: a backward reached a closed OffloadEngine; the strategy builds a new one for each fit.")
