"""`module.load_state_dict(state_dict)` of whole (unsharded) tensors into a model zoff has sharded, as code that does
not know zoff calls it: LitGPT's `load_checkpoint` under any strategy but FSDP's, a LightningModule's `on_fit_start`.
torch's own loading would copy a whole tensor into a DTensor shard (``aten.copy_.default got mixed torch.Tensor and
DTensor``), and a copy into the shards alone would not reach the fp32 masters the next step starts from.

So each module of the sharded model gets a load pre-hook that takes the whole tensors meant for its own sharded
parameters, once the module has renamed any keys (LitGPT's LoRA modules map a base model's names to theirs), out of
torch's hands. When the module `load_state_dict` was called on is done, its post-hook strikes those keys from torch's
missing ones and loads what was taken as `load_full_state_dict` does (each rank its rows, into the fp32 masters or the
frozen shards, and the 16-bit shards cast from the masters). A whole tensor whose shape differs stays for torch to
report; missing and unexpected keys and `strict` are torch's, so the sharded model loads what a plain one would.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_zoff.checkpoint.pretrained import OnDisk
from lightning_zoff.sharding import local_chunk, param_names

if TYPE_CHECKING:
    from lightning_zoff.contract import Core


class _Unread(OnDisk):
    """A tensor of Lightning's `lazy_load` (how LitGPT reads its checkpoints), read when it is copied: one whole tensor
    at a time, as torch's own loading reads them."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    @override
    def whole(self) -> torch.Tensor:
        return torch.detach(self.tensor)  # its `__torch_function__` reads it

    @override
    def local_chunk(self, world_size: int, rank: int) -> torch.Tensor:
        return local_chunk(self.whole(), world_size, rank)

    @override
    def shape_on_disk(self) -> list[int]:
        return list(self.tensor.shape)


class WholeLoads:
    """The hooks of one sharded model, `root`; `core` the core that holds it now (a later fit's may take it over)."""

    def __init__(self, root: nn.Module) -> None:
        self.root = weakref.ref(root)  # weak: the model holds these hooks
        self.core: weakref.ref[Core] | None = None
        self._caller: nn.Module | None = None  # the module whose load_state_dict runs
        self._taken: dict[int, Any] = {}  # the whole tensors taken, by id of their sharded parameter
        self._keys: set[str] = set()  # their keys, as torch counts them

    def take(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        """Load pre-hook: take the whole tensors for `module`'s own sharded parameters out of torch's hands."""
        if prefix == "" or self._caller is None:  # a new load (an earlier one that raised left nothing to flush)
            self._caller, self._taken, self._keys = module, {}, set()
        for name, param in module._parameters.items():
            value = state_dict.get(prefix + name)
            if not isinstance(param, DTensor) or not _is_whole(value) or tuple(value.shape) != tuple(param.shape):
                continue
            if self._holder() is None:
                raise RuntimeError("zoff: the strategy that set this model up no longer holds it (it was deleted, or"
                                   " set up another model since): load whole weights while it does, or into a new"
                                   " model before zoff sets it up.")
            self._taken[id(param)] = value if isinstance(value, torch.Tensor) else _Unread(value)
            self._keys.add(prefix + name)
            del state_dict[prefix + name]

    def flush(self, module: nn.Module, incompatible_keys: Any) -> None:
        """Load post-hook: once the called module is done, load what was taken, into the masters and the shards."""
        if module is not self._caller:
            return
        taken, keys = self._taken, self._keys
        self._caller, self._taken, self._keys = None, {}, set()
        missing = incompatible_keys.missing_keys
        missing[:] = [key for key in missing if key not in keys]  # taken, not missing
        core, root = self._holder(), self.root()
        if taken and core is not None and root is not None:
            names = param_names(root)
            core.load_full_state_dict({names[pid][0]: value for pid, value in taken.items()}, strict=False, prefix="")

    def _holder(self) -> Core | None:
        """The core, while it holds this model."""
        core = self.core() if self.core is not None else None
        return core if core is not None and core.module is self.root() else None


def _is_whole(value: Any) -> bool:
    # a plain tensor, or a tensor-like not yet read (Lightning's lazy_load); DTensors load as FSDP2 loads them
    return hasattr(value, "__torch_function__") and not isinstance(value, DTensor) and hasattr(value, "shape")


_HOOKED: weakref.WeakKeyDictionary[nn.Module, WholeLoads] = weakref.WeakKeyDictionary()


def route_whole_loads(module: nn.Module, core: Core) -> None:
    """Make `module.load_state_dict` (or a submodule's) load whole tensors through `core`, which holds `module` (it
    sharded it, or took it over sharded)."""
    hooks = _HOOKED.get(module)
    if hooks is None:
        hooks = _HOOKED[module] = WholeLoads(module)
        for submodule in module.modules():
            submodule.register_load_state_dict_pre_hook(hooks.take)
            submodule.register_load_state_dict_post_hook(hooks.flush)
    hooks.core = weakref.ref(core)
