"""A rank's checkpoints, for either front door: saving, loading and gathering the sharded fp32 master weights and
optimizer state of a module and its engine, in Lightning's checkpoint layout (``state_dict``, ``optimizer_states``, and
the rest as the door hands it). Every method here is a collective: each rank runs it, and each reads or writes only its
own rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_zoff.checkpoint import files as checkpoint_files
from lightning_zoff.checkpoint.pickling import UnpicklableCheckpoint, check_picklable
from lightning_zoff.checkpoint.pretrained import read_weights, to_module_names
from lightning_zoff.checkpoint.state import (
    StateMeshes,
    apply_weights,
    fill_from_full,
    finish_restore,
    full_optimizer_state,
    full_state_dict,
    mismatched_shapes,
    sharded_model_state,
    sharded_optimizer_state,
    unmatched_keys,
    weight_targets,
)
from lightning_zoff.config import ZoffConfig
from lightning_zoff.launch.group import RankGroup
from lightning_zoff.offload import OffloadEngine


class Checkpoints:
    """Checkpoints of the ranks `group` describes, written as `config` says, and whole weights in and out. The fp32
    masters live in the engine once the optimizer is set up; before that (no engine), loaded weights wait in the
    `masters` handed to `load` for the engine to take them."""

    def __init__(self, config: ZoffConfig, group: RankGroup) -> None:
        self.config, self.group = config, group
        self._meshes: StateMeshes | None = None  # built on first use

    @property
    def _full(self) -> bool:
        return self.config.state_dict_type == "full"

    def module_state_dict(self, module: nn.Module, engine: OffloadEngine | None) -> dict[str, Any]:
        # fp32 masters once the engine exists (views of this rank's rows when sharded); before, the model's shards
        if engine is None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=self._full, cpu_offload=self._full)
            return get_model_state_dict(module, options=options)
        engine.wait_idle()
        if self._full:
            return full_state_dict(module, engine)
        return sharded_model_state(module, engine, self._mesh())

    def optimizer_state(self, module: nn.Module, engine: OffloadEngine | None, optimizer: torch.optim.Optimizer
                        ) -> dict[str, Any] | None:
        """None before the engine exists (the door's own then)."""
        if engine is None:
            return None
        engine.wait_idle()
        if self._full:
            return full_optimizer_state(module, engine, optimizer)
        return sharded_optimizer_state(module, engine, optimizer, self._mesh())

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        group = self.group
        if storage_options is not None:
            raise TypeError("strategy='zoff' writes checkpoints itself and takes no storage_options.")
        checkpoint["zoff"] = checkpoint_files.zoff_info(checkpoint["state_dict"], self.config.state_dict_type,
                                                        group.world_size)
        # Every rank writes where rank 0 says, and refuses what rank 0 cannot pickle before anything is written: a
        # failed save leaves nothing behind, and no rank waits for one that failed.
        refusal = check_picklable(checkpoint_files.pickled_part(checkpoint, self.config.state_dict_type)
                                  ) if group.is_global_zero else None
        where, refusal = group.broadcast((str(filepath), refusal))
        if refusal is not None:
            raise UnpicklableCheckpoint(refusal)
        path = Path(where)
        if not self._full:
            checkpoint_files.save_sharded(checkpoint, path, group.global_rank, group.world_size, group.barrier)
        elif group.is_global_zero:
            checkpoint_files.save_full(checkpoint, path)

    def remove(self, filepath: Any) -> None:
        if self.group.is_global_zero:
            checkpoint_files.remove(Path(filepath))

    def load(self, checkpoint_path: Any, module: nn.Module, engine: OffloadEngine | None,
             masters: dict[int, torch.Tensor], optimizer: torch.optim.Optimizer | None,
             weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the weights, and the `optimizer`'s state when one is given and the checkpoint holds it, right here;
        the door restores the rest (loops, LR schedulers, callbacks, loss scaler) from the dict returned."""
        group = self.group
        path = Path(group.broadcast(str(checkpoint_path)))
        if group.is_global_zero:
            checkpoint_files.recover(path)
        group.barrier()
        checkpoint = checkpoint_files.read(path, weights_only)
        expected = {name: list(t.shape) for name, t in module.state_dict().items()}
        checkpoint_files.check_compatible(checkpoint, path, expected)
        if engine is None:
            targets = {"state_dict": weight_targets(module)}
            self._read_tensors(path, checkpoint, targets)
            apply_weights(module, targets["state_dict"], masters)
            return checkpoint
        engine.wait_idle()
        targets = {"state_dict": sharded_model_state(module, engine, self._mesh())}
        optimizer_state = None
        if optimizer is not None and "optimizer_states" in checkpoint:
            optimizer_state = sharded_optimizer_state(module, engine, optimizer, self._mesh())
            optimizer_state["param_groups"] = checkpoint["optimizer_states"][0]["param_groups"]
            targets["optimizer_0"] = optimizer_state["state"]
        self._read_tensors(path, checkpoint, targets)
        finish_restore(module, engine, optimizer, optimizer_state)
        return checkpoint

    def _read_tensors(self, path: Path, checkpoint: dict[str, Any], targets: dict[str, Any]) -> None:
        if path.is_dir():
            checkpoint_files.load_sharded(path, checkpoint["zoff"], targets)
            return
        full = {"state_dict": checkpoint["state_dict"]}
        if "optimizer_0" in targets:
            full["optimizer_0"] = checkpoint["optimizer_states"][0]["state"]
        fill_from_full(targets, full, self.group.world_size, self.group.global_rank)

    def _mesh(self) -> StateMeshes:
        if self._meshes is None:
            self._meshes = StateMeshes(self.group.world_size)
        return self._meshes

    def load_full_state_dict(
        self, module: nn.Module, engine: OffloadEngine | None, state_dict: dict[str, torch.Tensor] | str | Path,
        strict: bool = True, prefix: str | None = None, masters: dict[int, torch.Tensor] | None = None
    ) -> None:
        """Load whole (unsharded) weights, such as a pretrained model's, into the sharded model: every rank copies
        only its own rows into its fp32 master and refreshes its 16-bit shards. Call it once the model is sharded;
        before its optimizer is set up, the weights go to the `masters` the engine will start from.

        `state_dict` is a dict of tensors or a path: a directory written by Hugging Face `save_pretrained`
        (model.safetensors, sharded with model.safetensors.index.json, or pytorch_model.bin), a .safetensors file
        (a rank reads only its rows), or a torch.save file such as a .pt, .bin or Lightning .ckpt, or Fabric's
        `{"model": state_dict}` (memory-mapped). `prefix` goes before every name of the weights to give the module's
        (``"model."`` for a Hugging Face model held as ``self.model``); by default the prefix (none, or a submodule's
        name) under which the most names match. `strict=False` loads the names that match, but refuses weights of which
        none do. Missing or unexpected names (strict) and shapes that differ are refused before anything changes."""
        if engine is None and masters is None:
            raise RuntimeError("load_full_state_dict needs the sharded model: call it once fit has set up the strategy"
                               " (for example in `on_fit_start`).")
        weights: dict[str, Any] = read_weights(state_dict) if isinstance(state_dict, (str, Path)) else state_dict
        if engine is not None:
            engine.wait_idle()
            targets = sharded_model_state(module, engine, self._mesh())
        else:
            targets = weight_targets(module)
        state_dict, prefix = to_module_names(weights, targets.keys(), module, prefix)
        missing, unexpected = unmatched_keys(module, targets, state_dict)
        if strict and (missing or unexpected):
            renamed = f", the weights' names prefixed with {prefix!r}" if prefix else ""
            raise KeyError(f"load_full_state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}"
                           f" ({len(missing)} and {len(unexpected)}{renamed}); pass strict=False to load the keys that"
                           " match.")
        loaded = {k: v for k, v in targets.items() if k in state_dict}
        wrong = mismatched_shapes(loaded, state_dict)
        if wrong:
            raise ValueError(f"load_full_state_dict: shapes differ from the model's: {wrong[:8]}"
                             f"{f' and {len(wrong) - 8} more' if len(wrong) > 8 else ''}; these are weights of another"
                             " model or configuration.")
        fill_from_full(loaded, state_dict, self.group.world_size, self.group.global_rank)
        if engine is not None:
            finish_restore(module, engine, None, None)
        else:
            assert masters is not None
            apply_weights(module, loaded, masters)  # strict=False: the rest keep their values

    @staticmethod
    def full_state_dict(module: nn.Module, engine: OffloadEngine) -> dict[str, torch.Tensor]:
        """The module's state dict with fp32 master weights, on every rank (a collective)."""
        engine.wait_idle()
        return full_state_dict(module, engine)
