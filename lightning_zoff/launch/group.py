"""Where a rank stands among the others, and the two collectives the core needs (torch only): what a front door
hands to the core's helpers instead of itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def group_is_up() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if group_is_up():
        dist.barrier()


def broadcast(obj: Any, src: int = 0) -> Any:
    """`obj` as rank `src` has it, on every rank."""
    if not group_is_up():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src, group=dist.group.WORLD)
    return box[0]


@dataclass(frozen=True)
class RankGroup:
    """This rank's device, its rank among all (`global_rank`) and on its node (`local_rank`), and how many ranks there
    are in all and on each node."""

    device: torch.device
    world_size: int
    global_rank: int
    local_rank: int
    ranks_on_node: int

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def barrier(self) -> None:
        barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast(obj, src)
