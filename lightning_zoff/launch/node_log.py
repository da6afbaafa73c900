"""zoff's messages once per node, not once per rank: the ranks of a node set up and step alike, so the node's first
rank speaks for them; what differs from rank to rank (its cores) is logged at debug level by each."""

from __future__ import annotations

import logging
import warnings

import torch.distributed as dist
from typing_extensions import override

from lightning_zoff.launch.cpus import _ranges

log = logging.getLogger("lightning_zoff")  # every zoff module logs through this one logger


class _FirstRankOfNode(logging.Filter):
    local_rank = 0

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return self.local_rank == 0 or record.levelno <= logging.DEBUG


_filter = _FirstRankOfNode()


def speak_for_node(local_rank: int) -> None:
    """From now on, this process logs zoff's info lines, and shows Python warnings, only if it is the first rank of
    its node: the ranks of a node run the same code, so they would warn alike (errors still surface in every rank)."""
    _filter.local_rank = local_rank
    if _filter not in log.filters:
        log.addFilter(_filter)
    if local_rank != 0:
        warnings.simplefilter("ignore")


def log_for_node(line: str, global_rank: int, local_rank: int, ranks_on_node: int) -> None:
    """Log every rank's `line` once, from the node's first rank: each distinct line once, with the ranks that have it.
    A collective when torch.distributed is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        log.info("zoff rank %d: %s", global_rank, line)
        return
    lines = [""] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    if local_rank != 0:
        return
    by_text: dict[str, list[int]] = {}
    for rank in range(global_rank, global_rank + ranks_on_node):  # this node's ranks
        by_text.setdefault(lines[rank], []).append(rank)
    for text, ranks in by_text.items():
        log.info("zoff rank%s %s: %s", "s" if len(ranks) > 1 else "", _ranges(ranks), text)
