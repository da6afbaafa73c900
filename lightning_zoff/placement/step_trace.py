"""The step's accelerator memory beside the model's shards and the optimizer state, measured before anything is
allocated: one micro-batch's forward and backward run on fake tensors (shapes and dtypes, no data, no memory) at the
shape of a batch the loader made, on the rank's device, and the bytes of the tensors alive at once are counted as
they are made and freed (`LiveBytes`).

What the trace counts: the activations kept for backward (as the recompute switches stand), the loss's logits (HF
upcasts them to fp32), the gradients backward makes, and each parameter's gradient until it is accumulated. What it
does not run is FSDP2: its buffers (gathered units, unsharded gradients, reduce-scatter inputs, reduced shards) come
from the units' sizes, at their most (`StepMemory.gathered`) and, moved by the order the trace's gradients arrive in,
at each moment beside the activations alive then (`fsdp_buffers.py`, `StepMemory.together`). The parameters
themselves are the model's shards, which the plan counts already.

A step that cannot be traced (data-dependent shapes, a `.item()` in the forward, an op without a fake kernel) is not
an error: the plan then counts no activations, says so in one line, and "auto" reacts to the first step's peak as
before.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_zoff._compat import (
    DispatchMode,
    apply_to_tensors,
    direct_tensors,
    fake_tensor_mode,
    flop_formulas,
    replace_direct_tensor,
)
from lightning_zoff.placement.fsdp_buffers import Fsdp2Buffers, UnitBuffers
from lightning_zoff.placement.plan import StepMemory

log = logging.getLogger("lightning_zoff")


@dataclass(frozen=True)
class StepProbe:
    """What a door gives the plan to trace one micro-batch with."""

    make_batch: Callable[[], Any]  # one batch as the loader makes it (only its tensors' shapes and dtypes are read),
    # or None where none can be had without side effects; called only where the step is traced (on a GPU)
    loss_of: Callable[[Any], torch.Tensor]  # the training step's loss for a batch (the Trainer's: `training_step`)
    context: Callable[[], AbstractContextManager[Any]]  # the precision's forward context (autocast)


class LiveBytes(DispatchMode):  # type: ignore[no-untyped-call]
    """Counts the bytes of the storages ops make while it is active, until each is freed; `peak` is the most at once.
    A view, an in-place op or an op returning an input makes no new storage: only a storage none of the op's inputs
    has is counted."""

    def __init__(self, beside: Fsdp2Buffers | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.now = 0
        self.peak = 0
        self.beside = beside  # FSDP2's buffers, moved by the trace's backward
        self.together = 0  # the most this and `beside` held at one moment
        self._alive: dict[int, weakref.ref[Any]] = {}

    def note(self, beside_now: int) -> None:
        """A moment where FSDP2's buffers held `beside_now`: beside the bytes alive now."""
        self.together = max(self.together, self.now + beside_now)

    @override
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in _tensors_in((args, kwargs))}
        for tensor in _tensors_in(out):
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._alive:
                continue
            # fake tensors die in reference cycles: collected now, the ones already dead stop counting at this
            # allocation, as they would on the device (the young generations hold them: cheap)
            gc.collect(1)
            nbytes = storage.nbytes()
            self.now += nbytes
            self.peak = max(self.peak, self.now)
            if self.beside is not None:
                self.note(self.beside.now())
            self._alive[key] = weakref.ref(storage, self._freed(key, nbytes))
        return out

    def _freed(self, key: int, nbytes: int) -> Callable[[Any], None]:
        def freed(_: Any) -> None:
            self.now -= nbytes
            self._alive.pop(key, None)
        return freed


class OpFlops(DispatchMode):  # type: ignore[no-untyped-call]
    """Sums the floating-point operations of the ops run while it is active, by torch's own formulas (matrix products,
    convolutions, attention: nearly all of a transformer's work), from the shapes alone. torch's `FlopCounterMode`
    is not used: its module tracking holds tensors that a recomputed block would have freed."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.flops = 0
        self._formulas = flop_formulas()

    @override
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        formula = self._formulas.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **(kwargs or {}), out_val=out))
        return out


def _tensors_in(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    apply_to_tensors(keep, value)
    return found


def trace_step(module: nn.Module, probe: StepProbe, batch: Any, device: torch.device, param_dtype: torch.dtype
               ) -> int:
    """The most bytes the forward and backward of `batch` hold at once on `device`, the module's parameters aside
    (floating ones in `param_dtype`, as its shards are); raises whatever the module's step raised on fake tensors."""
    return trace_step_work(module, probe, batch, device, param_dtype).activations


@dataclass(frozen=True)
class TracedWork:
    activations: int  # the most bytes the step's own tensors held at once
    flops: int  # the forward's and backward's floating-point operations
    together: int  # the most those tensors and FSDP2's buffers held at one moment (0 without the units)


def trace_step_work(module: nn.Module, probe: StepProbe, batch: Any, device: torch.device, param_dtype: torch.dtype,
                    units: UnitBuffers | None = None) -> TracedWork:
    """`trace_step`'s bytes, the floating-point operations of the forward and backward (torch's FLOP counter:
    matrix products and attention, which are nearly all of a transformer's) and, given the FSDP2 `units`, the most
    held at one moment with their buffers, moved as the backward's gradients arrive (`fsdp_buffers.py`)."""
    rng_devices = [device] if device.type == "cuda" else []
    buffers = Fsdp2Buffers(units) if units is not None else None
    live = LiveBytes(beside=buffers)

    def arrived(original: int, param: torch.Tensor) -> None:
        if buffers is not None and original in buffers.units.unit_of:
            gc.collect(1)  # what died since the last allocation stops counting now, as it would on the device
            # the gradient is alive in the trace until dropped, and FSDP2's from now: counted once
            live.note(buffers.grad_arrived(buffers.units.unit_of[original], param.nbytes) - param.nbytes)

    with torch.random.fork_rng(devices=rng_devices), fake_tensor_mode(), \
            fake_parameters(module, device, param_dtype, arrived):
        batch = apply_to_tensors(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), batch)
        with OpFlops() as work, live:
            _run(probe, batch, buffers)
        return TracedWork(int(live.peak), work.flops, int(live.together) if buffers is not None else 0)


def _run(probe: StepProbe, batch: Any, buffers: Fsdp2Buffers | None) -> None:
    with probe.context():
        loss = probe.loss_of(batch)
    if buffers is not None:
        buffers.in_backward = True
    torch.autograd.backward(loss)  # the loss and the graph go when this returns


@contextmanager
def fake_parameters(module: nn.Module, device: torch.device, param_dtype: torch.dtype,
                    arrived: Callable[[int, torch.Tensor], None] | None = None) -> Iterator[None]:
    """Every parameter and buffer of `module` replaced by a fake one on `device` (floating parameters in
    `param_dtype`), tied ones still tied, each parameter's gradient handed to `arrived` (with the `id` of the
    parameter it replaces) and dropped once accumulated; put back after. Call inside a fake tensor mode."""
    fakes: dict[int, torch.Tensor] = {}
    replaced = []
    for owner in module.modules():
        for kind, name, tensor in direct_tensors(owner):
            if id(tensor) not in fakes:
                fakes[id(tensor)] = _fake_of(tensor, kind, device, param_dtype, arrived)
            replaced.append((owner, kind, name, tensor))
            replace_direct_tensor(owner, kind, name, fakes[id(tensor)])
    try:
        yield
    finally:
        for owner, kind, name, tensor in replaced:
            replace_direct_tensor(owner, kind, name, tensor)


def _fake_of(tensor: torch.Tensor, kind: str, device: torch.device, param_dtype: torch.dtype,
             arrived: Callable[[int, torch.Tensor], None] | None) -> torch.Tensor:
    dtype = param_dtype if kind == "param" and tensor.is_floating_point() else tensor.dtype
    fake = torch.empty(tensor.shape, dtype=dtype, device=device)
    if kind != "param":
        return fake
    param = nn.Parameter(fake, requires_grad=tensor.requires_grad)
    if param.requires_grad:
        original = id(tensor)

        def drop_grad(p: torch.Tensor) -> None:
            if arrived is not None:
                arrived(original, p)
            p.grad = None  # FSDP2 keeps it in the unit's unsharded gradient until the unit reduces: `arrived` counts

        param.register_post_accumulate_grad_hook(drop_grad)  # type: ignore[no-untyped-call]
    return param


def measure_step(module: nn.Module, probe: StepProbe | None, device: torch.device, param_dtype: torch.dtype,
                 gathered: int, units: UnitBuffers | None = None) -> StepMemory | None:
    """The step's memory at the batch `probe` makes (`gathered`: FSDP2's share at its most, from the units' sizes;
    `units`: FSDP2's units, for the most held at one moment); None where there is no probe or batch, and, with one
    line saying why, where the step cannot be traced on fake tensors."""
    batch = probe.make_batch() if probe is not None else None
    tensors = _tensors_in(batch)
    if probe is None or not tensors:
        return None
    shape = tensors[0].shape
    what = f"a batch of {' x '.join(str(n) for n in shape)}"
    try:
        work = trace_step_work(module, probe, batch, device, param_dtype, units)
    except Exception as err:  # the user's step on fake tensors: anything it raises means "not traceable"
        first = (str(err).strip().splitlines() or [""])[0]
        log.warning("zoff: the step at %s could not be traced on fake tensors (%s: %s); the plan counts no"
                    " activations, and the first step's peak decides", what, type(err).__name__, first[:200])
        return None
    return StepMemory(work.activations, gathered, what, samples=shape[0] if len(shape) else 1, flops=work.flops,
                      together=work.together)
