"""ZoffStrategy's checkpoints: saving, loading and gathering the sharded fp32 master weights and optimizer state. The
strategy owns one `Checkpoints` and its Lightning overrides call it. Every method here is a collective: each rank runs
it, and each reads or writes only its own rows."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn

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
from lightning_zoff.pretrained import read_weights, to_module_names

if TYPE_CHECKING:
    from lightning_zoff.strategy import ZoffStrategy


class Checkpoints:
    """The strategy's checkpoints, and whole weights in and out. The fp32 masters live in the strategy's engine once
    the optimizer is set up; before that, loaded weights wait in `strategy.masters` for the engine to take them."""

    def __init__(self, strategy: ZoffStrategy) -> None:
        self.strategy = strategy
        self._meshes: StateMeshes | None = None  # built on first use

    @property
    def _module(self) -> pl.LightningModule:
        return self.strategy.module

    @property
    def _full(self) -> bool:
        return self.strategy.config.state_dict_type == "full"

    def module_state_dict(self) -> dict[str, Any]:
        # fp32 masters once the engine exists (views of this rank's rows when sharded); before, the model's shards
        engine = self.strategy.engine
        if engine is None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=self._full, cpu_offload=self._full)
            return get_model_state_dict(self._module, options=options)
        engine.wait_idle()
        if self._full:
            return full_state_dict(self._module, engine)
        return sharded_model_state(self._module, engine, self._mesh())

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """None before the engine exists (Lightning's own then)."""
        engine = self.strategy.engine
        if engine is None:
            return None
        engine.wait_idle()
        if self._full:
            return full_optimizer_state(self._module, engine, optimizer)
        return sharded_optimizer_state(self._module, engine, optimizer, self._mesh())

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        strategy = self.strategy
        if storage_options is not None:
            raise TypeError("strategy='zoff' writes checkpoints itself and takes no storage_options.")
        path = Path(strategy.broadcast(str(filepath)))  # every rank writes where rank 0 says
        checkpoint["zoff"] = checkpoint_files.zoff_info(checkpoint["state_dict"], strategy.config.state_dict_type,
                                                        strategy.world_size)
        if not self._full:
            checkpoint_files.save_sharded(checkpoint, path, strategy.global_rank, strategy.world_size,
                                          strategy.barrier)
        elif strategy.is_global_zero:
            checkpoint_files.save_full(checkpoint, path)

    def remove(self, filepath: Any) -> None:
        if self.strategy.is_global_zero:
            checkpoint_files.remove(Path(filepath))

    def load(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Restores the weights (and, when fitting, the optimizer state) right here; Lightning restores the rest
        # (loops, LR schedulers, callbacks, loss scaler) from the dict returned.
        strategy = self.strategy
        path = Path(strategy.broadcast(str(checkpoint_path)))
        if strategy.is_global_zero:
            checkpoint_files.recover(path)
        strategy.barrier()
        module = self._module
        checkpoint = checkpoint_files.read(path, weights_only)
        expected = {name: list(t.shape) for name, t in module.state_dict().items()}
        checkpoint_files.check_compatible(checkpoint, path, expected)
        engine = strategy.engine
        if engine is None:
            targets = {"state_dict": weight_targets(module)}
            self._read_tensors(path, checkpoint, targets)
            apply_weights(module, targets["state_dict"], strategy.masters)
            return checkpoint
        engine.wait_idle()
        targets = {"state_dict": sharded_model_state(module, engine, self._mesh())}
        optimizer, optimizer_state = None, None
        if module.trainer.state.fn == TrainerFn.FITTING and "optimizer_states" in checkpoint:
            optimizer = strategy.optimizers[0]
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
        fill_from_full(targets, full, self.strategy.world_size, self.strategy.global_rank)

    def _mesh(self) -> StateMeshes:
        if self._meshes is None:
            self._meshes = StateMeshes(self.strategy.world_size)
        return self._meshes

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
        engine = self.strategy.engine
        if engine is None:
            raise RuntimeError("load_full_state_dict needs the sharded model and its optimizer state: call it once"
                               " fit has set up the strategy (for example in `on_fit_start`).")
        weights: dict[str, Any] = read_weights(state_dict) if isinstance(state_dict, (str, Path)) else state_dict
        engine.wait_idle()
        module = self._module
        targets = sharded_model_state(module, engine, self._mesh())
        state_dict, prefix = to_module_names(weights, targets.keys(), module, prefix)
        missing, unexpected = unmatched_keys(module, targets, state_dict)
        if strict and (missing or unexpected):
            renamed = f", the weights' names prefixed with {prefix!r}" if prefix else ""
            raise KeyError(f"load_full_state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}"
                           f" ({len(missing)} and {len(unexpected)}{renamed}); pass strict=False to load the keys that"
                           " match.")
        fill_from_full({k: v for k, v in targets.items() if k in state_dict}, state_dict, self.strategy.world_size,
                       self.strategy.global_rank)
        finish_restore(module, engine, None, None)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The LightningModule's state dict with fp32 master weights, on every rank (a collective)."""
        engine = self.strategy.engine
        assert engine is not None
        engine.wait_idle()
        return full_state_dict(self._module, engine)
