"""NCCL's memory is taken at setup, before the plan reads the GPU's free memory: the collectives a run makes later
(FSDP2's all-gather and reduce-scatter, a checkpoint's barrier and broadcast) allocate nothing outside torch's
allocator, which the plan lets fill the GPU (a late NCCL allocation on a full GPU fails as "unhandled cuda error")."""

from __future__ import annotations

from zoffbench.harness import call

MiB = 2**20


def memory_outside_the_allocator_around_collectives() -> dict[str, int]:
    import torch
    import torch.distributed as dist
    from lightning.fabric import Fabric

    from lightning_zoff import ZoffFabricStrategy

    fabric = Fabric(accelerator="cuda", devices=1, strategy=ZoffFabricStrategy(), precision="bf16-mixed")
    fabric.launch()  # the strategy's setup_environment: the rank joins its group

    def outside_allocator() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved()

    before = outside_allocator()
    world = dist.get_world_size()
    for dtype in (torch.float32, torch.bfloat16):
        shard = torch.ones(1 << 20, device=fabric.device, dtype=dtype)
        whole = torch.empty(shard.numel() * world, device=fabric.device, dtype=dtype)
        dist.all_gather_into_tensor(whole, shard)
        dist.reduce_scatter_tensor(shard, whole)
        dist.all_reduce(shard)
        dist.broadcast(shard, 0)
    dist.barrier()
    return {"before": before, "after": outside_allocator()}


def test_collectives_after_setup_allocate_nothing_outside_the_allocator():
    (memory,) = call(memory_outside_the_allocator_around_collectives)
    grown = memory["after"] - memory["before"]
    assert grown < 32 * MiB, f"NCCL took {grown / MiB:.0f} MiB after setup, outside the plan"
