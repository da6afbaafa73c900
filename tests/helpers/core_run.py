"""The tiny transformer's training on 2 gloo CPU ranks through `ShardedTraining` alone, no Lightning: run as
`python -m helpers.core_run OUT STEPS` from tests/ (a fresh interpreter, so that what the ranks import is theirs).
Each rank writes `OUT/rank{r}.pt`: its micro-batch losses and the final fp32 weights of a run uninterrupted, and of a
run saved after half the steps and resumed by a new `ShardedTraining` over a new model, and the Lightning modules it
loaded."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers.reference import SEED
from helpers.tiny import TinyLM, adamw, loss_of, micro_batch
from lightning_zoff.config import ZoffConfig
from lightning_zoff.launch.group import RankGroup
from lightning_zoff.precision_math import PrecisionMath
from lightning_zoff.training import ShardedTraining

WORLD_SIZE, ACCUMULATE, MAX_NORM = 2, 2, 0.84  # the tiny model's norms here: 0.79 to 0.87


def set_up(group: RankGroup, seed: int) -> tuple[ShardedTraining, torch.optim.Optimizer]:
    """A new model sharded and its AdamW's engine built, in the order a door calls them."""
    core = ShardedTraining(ZoffConfig(), group, root_runs_forward=True)  # this loop calls the model
    torch.manual_seed(seed)
    model = TinyLM()
    core.shard(model, torch.float32, fitting=True, accumulate_grad_batches=ACCUMULATE)
    optimizer = adamw(model)  # over the sharded parameters
    core.build_engine(optimizer, ACCUMULATE)
    return core, optimizer


def train(core: ShardedTraining, optimizer: torch.optim.Optimizer, first: int, last: int) -> tuple[list[float], list]:
    """Optimizer steps `first` to `last - 1`: this rank's micro-batch losses and the steps' outcomes."""
    precision, losses, outcomes = PrecisionMath("32-true"), [], []
    model = core.module
    for step in range(first, last):
        for micro in range(ACCUMULATE):
            x, y = micro_batch(step * ACCUMULATE + micro, dist.get_rank(), WORLD_SIZE)
            with core.forward():
                loss = loss_of(model, x, y)
            with core.backward(window_ends=micro == ACCUMULATE - 1, loss_scale=precision.loss_scale):
                (loss / ACCUMULATE).backward()
            losses.append(loss.item())
        precision.request_clip(MAX_NORM)
        outcomes.append(core.step(optimizer, precision, step))
        optimizer.zero_grad()
    return losses, outcomes


def finish(core: ShardedTraining) -> dict[str, torch.Tensor]:
    weights = core.full_state_dict()
    core.detach()
    core.close_engine()
    return weights


def rank(rank: int, port: int, out: Path, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    group = RankGroup(torch.device("cpu"), WORLD_SIZE, rank, rank, WORLD_SIZE)
    core, optimizer = set_up(group, SEED)
    losses, outcomes = train(core, optimizer, 0, steps)
    result = {"losses": losses, "clip_coefs": [o.clip_coef for o in outcomes], "skipped": [o.skipped for o in outcomes],
              "weights": finish(core)}

    core, optimizer = set_up(group, SEED)
    first_half, _ = train(core, optimizer, 0, steps // 2)
    checkpoint = {"state_dict": core.state_dict(), "optimizer_states": [core.optimizer_state(optimizer)]}
    core.save(checkpoint, out / "half.ckpt")
    finish(core)
    core, optimizer = set_up(group, SEED + 1)  # other weights, which the checkpoint replaces
    core.load(out / "half.ckpt", optimizer)
    second_half, _ = train(core, optimizer, steps // 2, steps)
    result |= {"resumed_losses": first_half + second_half, "resumed_weights": finish(core),
               "lightning": sorted(m for m in sys.modules if m.split(".")[0] == "lightning")}
    torch.save(result, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.start_processes(rank, args=(free_port, Path(sys.argv[1]), int(sys.argv[2])), nprocs=WORLD_SIZE,
                       start_method="fork")
