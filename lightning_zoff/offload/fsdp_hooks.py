"""Where the engine meets FSDP2: the hooks through which a unit's reduced gradient reaches it, the events that mark a
copy's end, and the gate that holds a unit's forward until its updated shards are on the accelerator. The hooks hold
the engine weakly, so a model outliving its Trainer does not keep the engine (its thread and its host state) alive."""

from __future__ import annotations

import weakref
from typing import NoReturn, Protocol, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_zoff._compat import all_gather_streams, before_reduce, restore_post_backward, unit_modules


class UnitEvents(Protocol):
    """What FSDP2's hooks tell the engine about unit `index` (its position in the engine's units)."""

    def on_grads_noted(self, index: int, used: list[bool]) -> None:
        """The unit is about to be reduced; `used`: per parameter that requires a gradient, whether it got one."""

    def on_unit_reduced(self, index: int, flat_grad: torch.Tensor) -> None:
        """The unit's reduced flat gradient shard, on the stream the hook was set with."""

    def gate(self, index: int) -> None:
        """Before the unit's forward (and FSDP2's all-gather for it)."""


class UnitHooks:
    """One unit's hooks, calling `events` (held weakly: a model outliving its Trainer keeps no engine alive)."""

    def __init__(self, module: nn.Module, events: UnitEvents, unit_index: int,
                 copy_stream: torch.cuda.Stream | None) -> None:
        self.module = cast(FSDPModule, module)  # a unit: fully_shard made it one
        ref = weakref.ref(events)

        def target() -> UnitEvents:
            alive = ref()
            if alive is None:
                _refuse_backward()
            return alive

        before_reduce(module, lambda used: target().on_grads_noted(unit_index, used))
        self.module.set_gradient_divide_factor(1.0)
        self.module.set_force_sum_reduction_for_comms(True)  # gloo has no AVG; the 1/world goes into the step
        self.module.set_all_reduce_hook(lambda flat_grad: target().on_unit_reduced(unit_index, flat_grad),
                                        stream=copy_stream)
        # prepend: before FSDP2's own pre-forward, whose all-gather reads the sharded parameters; on every module of a
        # group of tied modules, whichever runs first
        self._gates = [m.register_forward_pre_hook(lambda *_: target().gate(unit_index), prepend=True)
                       for m in unit_modules(module)]

    def remove(self) -> None:
        """FSDP2's reduce hook cannot be removed: it is pointed at one that refuses until the next engine's hooks
        replace it."""
        for gate in self._gates:
            gate.remove()
        self.module.set_all_reduce_hook(lambda flat_grad: _refuse_backward())
        restore_post_backward(cast(nn.Module, self.module))


def record_event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event at the current end of `stream`'s work (None without a CUDA stream: CPU copies are synchronous)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


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


def _refuse_backward() -> NoReturn:
    raise RuntimeError("zoff: a backward reached a closed OffloadEngine; the strategy builds a new one for each fit.")
