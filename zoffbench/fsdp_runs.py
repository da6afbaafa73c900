"""bench.py's FSDP runs with the optimizer on the CPU, set up as their docs say; Lightning and torch are imported
only when a run is built.

- fsdp2_cpu_offload: FSDP2's `fully_shard(offload_policy=CPUOffloadPolicy())` over each block and the root, under
  Lightning's ModelParallelStrategy. CPU offload needs the sharded parameters on the CPU (torch raises "FSDP parameters
  should be materialized on CPU when enabling CPU offloading" at the first forward otherwise): the model is built on
  the CPU, `fully_shard` moves each shard there (pinned) and the buffers to the GPU, and the strategy's
  `model_to_device`, which would then move the whole module to the GPU, leaves it where FSDP2 put it.
- fsdp_cpu_offload: Lightning's `FSDPStrategy(cpu_offload=True)` (FSDP1), each block a unit, the model built on the
  CPU (FSDP moves a unit to the GPU to shard it and keeps its flat parameters on the CPU). Lightning's FSDP precision
  plugin refuses clipping by norm, so the module clips with FSDP's own `clip_grad_norm_` (the norm over the shards).
  Lightning's FSDPStrategy needs a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from typing_extensions import override

if TYPE_CHECKING:  # types only: Lightning and torch are imported when a run is built
    from lightning.pytorch import LightningModule as _MixedInto
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel
else:
    _MixedInto = object  # a LightningModule to the checker; at run time with_mixin puts the mixin before the family

FSDP2_RUN, FSDP_RUN = "fsdp2_cpu_offload", "fsdp_cpu_offload"


def host_params_strategy() -> Any:
    """Lightning's ModelParallelStrategy, less its move of the sharded module to the GPU."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    class HostParamsModelParallelStrategy(ModelParallelStrategy):
        @override
        def model_to_device(self) -> None:
            pass  # fully_shard put the shards on the host (CPUOffloadPolicy) and the buffers on the GPU already

    return HostParamsModelParallelStrategy()


class ShardedByFSDP2WithCPUOffload(_MixedInto):
    """Mixed into a run's LightningModule class: FSDP2 over each block and the root, with its own CPUOffloadPolicy."""

    model: nn.Module  # the family's model

    @override
    def configure_model(self) -> None:
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        from lightning_zoff.units import repeated_blocks

        # pinned host shards on a GPU (the default); on CPU ranks there is no accelerator to pin for (torch refuses)
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        mesh = cast("DeviceMesh", self.device_mesh)["data_parallel"]  # ModelParallelStrategy set it before this hook
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy: dict[str, Any] = dict(mesh=mesh, offload_policy=offload, mp_policy=mp_policy)
        for block in repeated_blocks(self.model):
            fully_shard(block, **policy)
        fully_shard(self.model, **policy)


def fsdp1_strategy(block: type, recompute: bool) -> Any:
    """Lightning's FSDPStrategy with the parameters, gradients and optimizer on the CPU, each `block` a unit."""
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy(cpu_offload=True, auto_wrap_policy={block},
                        activation_checkpointing_policy={block} if recompute else None)


class ClippedByFSDP(_MixedInto):
    """Mixed into a run's LightningModule class under FSDPStrategy: clipping by FSDP's own norm."""

    @override
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        if gradient_clip_val:
            # FSDPStrategy wrapped the module: the Trainer's model is the root FSDP unit
            cast("FullyShardedDataParallel", self.trainer.model).clip_grad_norm_(gradient_clip_val)
