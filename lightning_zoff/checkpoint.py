"""Full (unsharded) fp32 state dicts gathered from the engine's master shards."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_zoff.offload import OffloadEngine


# torch 2.13 renamed all_gather_into_tensor (2.11 has only the old name)
_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def full_state_dict(module: nn.Module, engine: OffloadEngine) -> dict[str, torch.Tensor]:
    """The module's state dict with every parameter as its full fp32 master on the CPU. A collective: every rank
    calls it and gets the whole dict."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    full: dict[str, torch.Tensor] = {}
    for unit in engine.units:
        master = unit.master.cpu()
        gathered = torch.empty(engine.world_size * master.numel(), dtype=master.dtype)
        if engine.world_size > 1:
            _all_gather_flat(gathered, master)
        else:
            gathered.copy_(master)
        per_rank = gathered.view(engine.world_size, -1)
        for slot in unit.layout.slots:
            shape = slot.param.shape
            rows = per_rank[:, slot.offset : slot.offset + slot.padded_numel].reshape(-1, *shape[1:])
            tensor = rows[: shape[0]].reshape(shape).clone() if len(shape) else rows.reshape(()).clone()
            for name in names[id(slot.param)]:
                full[name] = tensor
    state = {}
    for key, value in module.state_dict().items():
        state[key] = full[key] if key in full else value.detach().cpu().clone()
    return state
