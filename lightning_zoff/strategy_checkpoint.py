"""The checkpoint half of ZoffStrategy: saving, loading and gathering the sharded fp32 master weights and optimizer
state. Every method here is a collective: each rank runs it, and each reads or writes only its own rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_zoff import checkpoint_files
from lightning_zoff.checkpoint import (
    StateMeshes,
    apply_weights,
    fill_from_full,
    finish_restore,
    full_optimizer_state,
    full_state_dict,
    sharded_model_state,
    sharded_optimizer_state,
    unmatched_keys,
    weight_targets,
)
from lightning_zoff.offload import OffloadEngine
from lightning_zoff.pretrained import read_weights, to_module_names


class CheckpointingStrategy(ParallelStrategy):
    """ZoffStrategy's base: its checkpoints, and whole weights in and out. The fp32 masters live in `engine` once the
    optimizer is set up; before that, loaded weights wait in `_masters` for the engine to take them."""

    engine: OffloadEngine | None
    state_dict_type: str
    _masters: dict[int, torch.Tensor]
    _state_mesh: Any  # the StateMeshes of the checkpoints, built on first use

    @property
    def _module(self) -> pl.LightningModule:
        """The LightningModule: Lightning connects it before any of these run."""
        module = self.lightning_module
        assert module is not None, "zoff: the strategy has no LightningModule yet"
        return module

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # fp32 masters once the engine exists (views of this rank's rows when sharded); before, the model's shards
        if self.engine is None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = self.state_dict_type == "full"
            options = StateDictOptions(full_state_dict=full, cpu_offload=full)
            return get_model_state_dict(self._module, options=options)
        self.engine.wait_idle()
        if self.state_dict_type == "full":
            return full_state_dict(self._module, self.engine)
        return sharded_model_state(self._module, self.engine, self._mesh())

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        if self.engine is None:
            return super().optimizer_state(optimizer)
        self.engine.wait_idle()
        if self.state_dict_type == "full":
            return full_optimizer_state(self._module, self.engine, optimizer)
        return sharded_optimizer_state(self._module, self.engine, optimizer, self._mesh())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("strategy='zoff' writes checkpoints itself and takes no storage_options.")
        path = Path(self.broadcast(str(filepath)))  # every rank writes where rank 0 says
        checkpoint["zoff"] = checkpoint_files.zoff_info(checkpoint["state_dict"], self.state_dict_type, self.world_size)
        if self.state_dict_type == "sharded":
            checkpoint_files.save_sharded(checkpoint, path, self.global_rank, self.world_size, self.barrier)
        elif self.is_global_zero:
            checkpoint_files.save_full(checkpoint, path)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            checkpoint_files.remove(Path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Restores the weights (and, when fitting, the optimizer state) right here; Lightning restores the rest
        # (loops, LR schedulers, callbacks, loss scaler) from the dict returned.
        path = Path(self.broadcast(str(checkpoint_path)))
        if self.is_global_zero:
            checkpoint_files.recover(path)
        self.barrier()
        module = self._module
        checkpoint = checkpoint_files.read(path, weights_only)
        expected = {name: list(t.shape) for name, t in module.state_dict().items()}
        checkpoint_files.check_compatible(checkpoint, path, expected)
        if self.engine is None:
            targets = {"state_dict": weight_targets(module)}
            self._read_tensors(path, checkpoint, targets)
            apply_weights(module, targets["state_dict"], self._masters)
            return checkpoint
        self.engine.wait_idle()
        targets = {"state_dict": sharded_model_state(module, self.engine, self._mesh())}
        optimizer, optimizer_state = None, None
        if module.trainer.state.fn == TrainerFn.FITTING and "optimizer_states" in checkpoint:
            optimizer = self.optimizers[0]
            optimizer_state = sharded_optimizer_state(module, self.engine, optimizer, self._mesh())
            optimizer_state["param_groups"] = checkpoint["optimizer_states"][0]["param_groups"]
            targets["optimizer_0"] = optimizer_state["state"]
        self._read_tensors(path, checkpoint, targets)
        finish_restore(module, self.engine, optimizer, optimizer_state)
        return checkpoint

    def _read_tensors(self, path: Path, checkpoint: dict[str, Any], targets: dict[str, Any]) -> None:
        if path.is_dir():
            checkpoint_files.load_sharded(path, checkpoint["zoff"], targets)
            return
        full = {"state_dict": checkpoint["state_dict"]}
        if "optimizer_0" in targets:
            full["optimizer_0"] = checkpoint["optimizer_states"][0]["state"]
        fill_from_full(targets, full, self.world_size, self.global_rank)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint

    def _mesh(self) -> StateMeshes:
        if self._state_mesh is None:
            self._state_mesh = StateMeshes(self.world_size)
        return self._state_mesh

    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor] | str | Path, strict: bool = True, prefix: str | None = None
    ) -> None:
        """Load whole (unsharded) weights, such as a pretrained model's, into the sharded model: every rank copies
        only its own rows into its fp32 master and refreshes its 16-bit shards. Call it once the strategy is set up
        (for example in `on_fit_start`).

        `state_dict` is a dict of tensors or a path: a directory written by Hugging Face `save_pretrained`
        (model.safetensors, sharded with model.safetensors.index.json, or pytorch_model.bin), a .safetensors file
        (a rank reads only its rows), or a torch.save file such as a .pt, .bin or Lightning .ckpt (memory-mapped).
        `prefix` goes before every name of the weights to give the LightningModule's (``"model."`` for a Hugging Face
        model held as ``self.model``); by default the prefix (none, or a submodule's name) under which the most names
        match. `strict=False` loads the names that match, but refuses weights of which none do."""
        if self.engine is None:
            raise RuntimeError("load_full_state_dict needs the sharded model and its optimizer state: call it once"
                               " fit has set up the strategy (for example in `on_fit_start`).")
        weights: dict[str, Any] = read_weights(state_dict) if isinstance(state_dict, (str, Path)) else state_dict
        self.engine.wait_idle()
        module = self._module
        targets = sharded_model_state(module, self.engine, self._mesh())
        state_dict, prefix = to_module_names(weights, targets.keys(), module, prefix)
        missing, unexpected = unmatched_keys(module, targets, state_dict)
        if strict and (missing or unexpected):
            renamed = f", the weights' names prefixed with {prefix!r}" if prefix else ""
            raise KeyError(f"load_full_state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}"
                           f" ({len(missing)} and {len(unexpected)}{renamed}); pass strict=False to load the keys that"
                           " match.")
        fill_from_full({k: v for k, v in targets.items() if k in state_dict}, state_dict, self.world_size,
                       self.global_rank)
        finish_restore(module, self.engine, None, None)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The LightningModule's state dict with fp32 master weights, on every rank (a collective)."""
        assert self.engine is not None
        self.engine.wait_idle()
        return full_state_dict(self._module, self.engine)
