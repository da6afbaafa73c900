"""`model.load_state_dict(state_dict, strict=...)` of whole (unsharded) tensors into a model zoff has set up, as code
that does not know zoff calls it, through both doors: Fabric's (after `fabric.setup`, before or after
`fabric.setup_optimizers`; LitGPT's `load_checkpoint` does this) and the Trainer's (in `on_fit_start`). Against the same
load into the plain model under DDP: the fp32 weights right after the load, the keys torch reports missing and
unexpected, the 16-bit shards the forward uses, and a step from the loaded weights. Units whose state is on the host,
on the accelerator and both; plain tensors and Lightning's lazily read ones (`lazy_load`, LitGPT's reader); the whole
model and a submodule."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.utilities.load import _lazy_load
from torch.distributed.tensor import DTensor

import helpers.trainer
from helpers.fabric_loop import FabricTiny, micro_batch
from helpers.tiny import token_loader
from helpers.tiny_module import TinyModule, read_probe
from lightning_zoff import ZoffFabricStrategy, ZoffStrategy


def pretrained() -> dict[str, torch.Tensor]:
    """Weights unlike any initialisation, by the LightningModule's names."""
    torch.manual_seed(123)
    return {name: torch.randn_like(value) * 0.05 for name, value in FabricTiny().state_dict().items()}


def some_of(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A partial state dict: the second block and the head keep their own initialisation."""
    return {k: v for k, v in weights.items() if not k.startswith(("model.blocks.1.", "model.head."))}


def of_submodule(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict of the network the LightningModule holds as `self.model`."""
    return {k.removeprefix("model."): v for k, v in weights.items()}


def whole(fabric_or_trainer_strategy, module) -> dict[str, torch.Tensor]:
    """The fp32 weights whole: zoff's masters gathered (a collective), or the plain module's under DDP."""
    full = getattr(fabric_or_trainer_strategy, "full_state_dict", None)
    return {k: v.detach().cpu().clone() for k, v in (full() if full is not None else module.state_dict()).items()}


def shards(module) -> dict[str, torch.Tensor]:
    """The module's own tensors as the forward uses them: zoff's 16-bit shards gathered (DTensors), DDP's plain."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in module.state_dict().items()}


# -- Fabric's door ----------------------------------------------------------------------------------------------


def fabric_load(fabric: Fabric, path: str, strict: bool, lazy: bool, before_optimizer: bool, submodule: bool,
                out: str) -> list[float]:
    """Set up, load with `load_state_dict`, one step; what rank 0 saw goes to the file `out`."""
    fabric.seed_everything(7)
    module = FabricTiny()
    model = fabric.setup(module)
    optimizer = None if before_optimizer else fabric.setup_optimizers(module.configure_optimizers())
    weights = _lazy_load(path) if lazy else torch.load(path)
    result = (module.model if submodule else model).load_state_dict(weights, strict=strict)
    if optimizer is None:
        optimizer = fabric.setup_optimizers(module.configure_optimizers())
    seen = {"loaded": whole(fabric.strategy, module), "shards": shards(module), "missing": result.missing_keys,
            "unexpected": result.unexpected_keys}
    x, y = micro_batch(0, fabric.global_rank, fabric.world_size)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    fabric.backward(loss)
    optimizer.step()
    seen["stepped"] = whole(fabric.strategy, module)
    if fabric.is_global_zero:
        torch.save(seen, out)
    return [fabric.all_reduce(loss.detach(), reduce_op="mean").item()]


FABRIC_CASES = {  # weights, strict, lazily read, before the optimizer, into the submodule, zoff's accelerator_state
    "all, strict, host": (None, True, False, False, False, "none"),
    "some, not strict, lazy, accelerator": (some_of, False, True, True, False, 1.0),
    "submodule, strict, lazy, both": (of_submodule, True, True, False, True, 0.5),
}


@pytest.mark.parametrize("case", FABRIC_CASES)
def test_fabric_load_state_dict_of_whole_tensors_is_ddps(tmp_path, case):
    select, strict, lazy, before_optimizer, submodule, accelerator_state = FABRIC_CASES[case]
    weights = pretrained()
    path = tmp_path / "weights.pth"
    torch.save(select(weights) if select else weights, path)
    args = (str(path), strict, lazy, before_optimizer, submodule)
    ddp = Fabric(accelerator="cpu", devices=2, strategy="ddp_fork").launch(fabric_load, *args, str(tmp_path / "d.pt"))
    zoff = Fabric(accelerator="cpu", devices=2, strategy=ZoffFabricStrategy(
        start_method="fork", accelerator_state=accelerator_state)).launch(fabric_load, *args, str(tmp_path / "z.pt"))
    seen_ddp, seen_zoff = torch.load(tmp_path / "d.pt"), torch.load(tmp_path / "z.pt")
    assert (seen_zoff["missing"], seen_zoff["unexpected"]) == (seen_ddp["missing"], seen_ddp["unexpected"])
    assert bool(seen_ddp["missing"]) != strict  # a partial state dict leaves keys missing
    for name, value in seen_ddp["loaded"].items():
        assert torch.equal(seen_zoff["loaded"][name], value), name  # the fp32 masters: bit for bit
        assert torch.equal(seen_zoff["shards"][name], value), name  # the shards the forward uses agree
    assert zoff == pytest.approx(ddp, rel=1e-6)
    for name, value in seen_ddp["stepped"].items():
        torch.testing.assert_close(seen_zoff["stepped"][name], value, rtol=1e-5, atol=1e-6)
    assert not torch.equal(seen_zoff["stepped"]["model.emb.weight"], seen_zoff["loaded"]["model.emb.weight"])


def fabric_bf16_load(fabric: Fabric, path: str, out: str) -> None:
    fabric.seed_everything(7)
    module = FabricTiny()
    model = fabric.setup(module)
    optimizer = fabric.setup_optimizers(module.configure_optimizers())
    model.load_state_dict(torch.load(path))
    seen = {"loaded": whole(fabric.strategy, module), "shards": shards(module)}
    x, y = micro_batch(0, fabric.global_rank, fabric.world_size)
    fabric.backward(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()))
    optimizer.step()
    seen |= {"stepped": whole(fabric.strategy, module), "stepped_shards": shards(module)}
    if fabric.is_global_zero:
        torch.save(seen, out)


def test_the_bf16_shards_are_the_cast_of_the_loaded_masters(tmp_path):
    weights = pretrained()
    torch.save(weights, tmp_path / "weights.pth")
    Fabric(accelerator="cpu", devices=2, strategy=ZoffFabricStrategy(start_method="fork"), precision="bf16-mixed"
           ).launch(fabric_bf16_load, str(tmp_path / "weights.pth"), str(tmp_path / "z.pt"))
    seen = torch.load(tmp_path / "z.pt")
    for name, value in weights.items():
        assert torch.equal(seen["loaded"][name], value), name
        assert seen["shards"][name].dtype == torch.bfloat16
        assert torch.equal(seen["shards"][name], value.to(torch.bfloat16)), name
        assert torch.equal(seen["stepped_shards"][name], seen["stepped"][name].to(torch.bfloat16)), name


def refusals(fabric: Fabric, path: str, case: str) -> None:
    fabric.seed_everything(7)
    module = FabricTiny()
    model = fabric.setup(module)
    fabric.setup_optimizers(module.configure_optimizers())
    if case == "another":  # the strategy set up another model since: the first's state is gone
        fabric.setup(FabricTiny())
    model.load_state_dict(torch.load(path))


@pytest.mark.parametrize(("case", "message"), [
    ("missing", r"Missing key\(s\) in state_dict: \"model.head.weight\""),
    ("shape", r"size mismatch for model.head.weight: copying a param with shape torch.Size\(\[32, 32\]\)"),
    ("another", r"zoff: the strategy that set this model up no longer holds it \(it was deleted, or set up another"),
])
def test_what_torch_refuses_it_refuses_in_its_words(tmp_path, case, message):
    weights = pretrained()
    if case == "missing":
        del weights["model.head.weight"]
    elif case == "shape":
        weights["model.head.weight"] = weights["model.head.weight"][:32]
    torch.save(weights, tmp_path / "weights.pth")
    if case != "another":  # the plain model's own words
        with pytest.raises(RuntimeError, match=message):
            FabricTiny().load_state_dict(weights)
    with pytest.raises(RuntimeError, match=message):  # the same type as torch's own, raised from the rank as it is
        Fabric(accelerator="cpu", devices=2, strategy=ZoffFabricStrategy(start_method="fork")).launch(
            refusals, str(tmp_path / "weights.pth"), case)


# -- the Trainer's door -----------------------------------------------------------------------------------------


class LoadsAtFitStart(TinyModule):
    """Loads whole weights with `load_state_dict` in `on_fit_start`, into itself or into `self.model`; what rank 0
    saw right after goes to `out`."""

    def __init__(self, path: Path, strict: bool, submodule: bool, out: Path) -> None:
        super().__init__()
        self.path, self.strict, self.submodule, self.out = path, strict, submodule, out

    def on_fit_start(self) -> None:
        result = (self.model if self.submodule else self).load_state_dict(torch.load(self.path), strict=self.strict)
        seen = {"loaded": whole(self.trainer.strategy, self), "missing": result.missing_keys}
        if self.trainer.is_global_zero:
            torch.save(seen, self.out)


TRAINER_CASES = {"all, strict, host": (None, True, False, "none"),
                 "submodule, some, not strict, both": (some_of, False, True, 0.5)}


@pytest.mark.parametrize("case", TRAINER_CASES)
def test_trainer_load_state_dict_of_whole_tensors_is_ddps(tmp_path, case):
    select, strict, submodule, accelerator_state = TRAINER_CASES[case]
    weights = select(pretrained()) if select else pretrained()
    path = tmp_path / "weights.pth"
    torch.save(of_submodule(weights) if submodule else weights, path)
    trained = {}
    for name, strategy in (("ddp", "ddp_fork"), ("zoff", ZoffStrategy(
            start_method="fork", accelerator_state=accelerator_state, weights_to_main_process=True))):
        pl.seed_everything(7)
        module = LoadsAtFitStart(path, strict, submodule, tmp_path / f"{name}.pt")
        helpers.trainer.fit(module, token_loader(), strategy, out=tmp_path / name, max_steps=2)
        trained[name] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    seen_ddp, seen_zoff = torch.load(tmp_path / "ddp.pt"), torch.load(tmp_path / "zoff.pt")
    assert seen_zoff["missing"] == seen_ddp["missing"]
    assert bool(seen_ddp["missing"]) != strict  # a partial state dict leaves keys missing
    for name, value in seen_ddp["loaded"].items():
        assert torch.equal(seen_zoff["loaded"][name], value), name
    losses = read_probe(tmp_path / "zoff")["losses"], read_probe(tmp_path / "ddp")["losses"]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for name, value in trained["ddp"].items():
        torch.testing.assert_close(trained["zoff"][name], value, rtol=1e-5, atol=1e-6)
