"""Host memory a rank's engine will hold, checked against the machine before any of it is allocated."""

from __future__ import annotations

import logging
import os
from typing import cast

import psutil
from torch.distributed.tensor import DTensor

from lightning_zoff.offload.layout import UnitLayout

log = logging.getLogger("lightning_zoff")
# overlap's spare pool, per trained element: sets of spare state for a few units (scheduler.spare_pool_for)
SPARE_BYTES_PER_PARAM = 1


def host_bytes_per_element(*, param_bytes: int, second_moment: bool, overlap: bool, accum_bytes: int,
                           moment_bytes: int = 4) -> int:
    """Host bytes per element of a rank's flat shard: fp32 master and the moments (`moment_bytes` each), with overlap
    the speculation's spare pool (`SPARE_BYTES_PER_PARAM`), the window's gradient sum (`accum_bytes`: 0 when every
    window is one micro-batch, whose gradient the kernel reads from the staging buffer), and the staging buffers the
    copies land in and leave from."""
    state = 4 + moment_bytes * (2 if second_moment else 1)
    staging = param_bytes + (0 if param_bytes == 4 else param_bytes)  # fp32 params go back from the master itself
    return state + (SPARE_BYTES_PER_PARAM if overlap else 0) + accum_bytes + staging


def host_memory_total() -> int:
    """The machine's memory; ZOFF_HOST_MEMORY_BYTES overrides it (tests, shared hosts)."""
    return int(os.environ.get("ZOFF_HOST_MEMORY_BYTES", 0)) or psutil.virtual_memory().total


def host_bytes(trained: int, reduced: int, *, param_bytes: int, second_moment: bool, overlap: bool, accum_bytes: int,
               moment_bytes: int) -> int:
    """Host bytes of a rank whose optimizer trains `trained` elements of a flat shard in which FSDP2 reduces `reduced`
    (parameters that require a gradient; `trained` <= `reduced`: those outside the optimizer get no state). Frozen
    parameters cost nothing on the host."""
    per_trained = host_bytes_per_element(param_bytes=param_bytes, second_moment=second_moment, overlap=overlap,
                                         accum_bytes=0, moment_bytes=moment_bytes) - param_bytes
    return trained * per_trained + reduced * (accum_bytes + param_bytes)


def check_host_budget(elements: int, ranks_on_node: int, *, param_bytes: int, second_moment: bool, overlap: bool,
                      accum_bytes: int, moment_bytes: int, reduced: int | None = None, untrained: int = 0) -> None:
    """Refuse a model whose host state cannot fit in this machine's memory, naming the bytes and what would fit;
    warn when it exceeds what is free now. `elements`: of this rank's shard that the optimizer trains; `reduced`: of
    its reduced gradient (default `elements`); `untrained`: elements that keep no host state (frozen, or outside the
    optimizer), for the message. ZOFF_HOST_MEMORY_BYTES overrides the machine's total (tests, shared hosts)."""
    options = dict(param_bytes=param_bytes, second_moment=second_moment, overlap=overlap, accum_bytes=accum_bytes,
                   moment_bytes=moment_bytes)
    reduced = elements if reduced is None else reduced

    def needs(**change: object) -> int:  # bytes on this node, with some options changed
        return ranks_on_node * host_bytes(elements, reduced, **{**options, **change})  # type: ignore[arg-type]

    needed = needs()
    memory = psutil.virtual_memory()
    total = host_memory_total()
    gb = 1e9
    trained = (f"{elements:,} trained elements ({untrained:,} more are frozen or outside the optimizer and keep no"
               " host state)" if untrained else f"{elements:,} elements")
    if needed > total:
        smaller: list[str] = []
        together: dict[str, object] = {}
        if overlap:
            smaller.append(f"overlap=False ({needs(overlap=False) / gb:.1f} GB)")
            together["overlap"] = False
        if moment_bytes == 4:
            smaller.append(f"optimizer_state_dtype='bf16' ({needs(moment_bytes=2) / gb:.1f} GB)")
            together["moment_bytes"] = 2
        if accum_bytes == 4 and param_bytes == 2:
            smaller.append(f"grad_accum_dtype='bf16' or 'fp16' ({needs(accum_bytes=2) / gb:.1f} GB)")
            together["accum_bytes"] = 2
        if len(together) > 1:
            smaller.append(f"all of these ({needs(**together) / gb:.1f} GB)")
        smaller.append("accelerator_state=<a fraction> (that share of the state stays on the GPU instead)")
        smaller.append("more nodes (the host state splits across all ranks)")
        raise MemoryError(
            f"zoff: the optimizer state needs {needed / gb:.1f} GB of host memory on this node ({ranks_on_node} rank(s)"
            f" x {trained} x {needed / ranks_on_node / max(elements, 1):.3g} B) but the machine has"
            f" {total / gb:.1f} GB. Options: " + "; ".join(smaller) + "."
        )
    if needed > memory.available:
        log.warning("zoff: the optimizer state needs %.1f GB of host memory on this node, more than the %.1f GB free"
                    " now", needed / gb, memory.available / gb)


def check_unit_budget(layouts: list[UnitLayout], group_of: dict[int, int], ranks_on_node: int, *, second_moment: bool,
                      overlap: bool, accum_bytes: int, moment_bytes: int) -> None:
    """`check_host_budget` for the units' host state: their trained parameters (those in `group_of`, by id)."""
    trained = [s for layout in layouts for s in layout.slots if id(s.param) in group_of]
    if not trained:
        return
    untrained = sum(cast(DTensor, p).to_local().numel() for layout in layouts
                    for p in [*(s.param for s in layout.slots if id(s.param) not in group_of), *layout.frozen])
    check_host_budget(
        sum(s.padded_numel for s in trained), ranks_on_node, reduced=sum(layout.flat_numel for layout in layouts),
        untrained=untrained, param_bytes=trained[0].param.element_size(), second_moment=second_moment,
        overlap=overlap, accum_bytes=accum_bytes, moment_bytes=moment_bytes,
    )
