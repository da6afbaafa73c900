"""`fabric.load_raw(path, model)` under `Fabric(strategy="zoff")`: whole weights (a plain `state_dict()` file, Fabric's
`{"model": ...}` file, safetensors) into the sharded model, before or after its optimizer is set up, on 2 and 3 forked
CPU ranks; then a step equal to Fabric DDP's from the same weights. Wrong names or shapes are refused before anything
changes; the optimizer is not a raw load's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from safetensors.torch import save_file

from helpers.fabric_loop import FabricTiny, micro_batch
from lightning_zoff import ZoffFabricStrategy


def pretrained() -> dict[str, torch.Tensor]:
    """Weights unlike any initialisation: what a pretrained model's file holds."""
    torch.manual_seed(123)
    return {name: torch.randn_like(value) * 0.05 for name, value in FabricTiny().state_dict().items()}


def zoff_fabric(devices: int) -> Fabric:
    return Fabric(accelerator="cpu", devices=devices, strategy=ZoffFabricStrategy(start_method="fork"))


def load_and_step(fabric: Fabric, path: str, before_optimizer: bool, weights_to: str) -> list[float]:
    """The loss of two steps from the loaded weights; the weights right after the load (gathered whole) go to the file
    `weights_to` (tensors do not return through the launcher's queue once the ranks have ended)."""
    fabric.seed_everything(7)
    module = FabricTiny()
    model = fabric.setup(module)
    if before_optimizer:
        fabric.load_raw(path, model)
    optimizer = fabric.setup_optimizers(module.configure_optimizers())
    if not before_optimizer:
        fabric.load_raw(path, model)
    full = getattr(fabric.strategy, "full_state_dict", None)
    loaded = full() if full is not None else module.state_dict()
    if fabric.is_global_zero:
        torch.save({k: v.cpu() for k, v in loaded.items()}, weights_to)
    losses = []
    for step in range(2):
        x, y = micro_batch(step, fabric.global_rank, fabric.world_size)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return losses


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    weights = pretrained()
    out = tmp_path_factory.mktemp("weights")
    torch.save(weights, out / "plain.pth")
    torch.save({"model": weights}, out / "fabric.pth")
    save_file(weights, str(out / "model.safetensors"))
    ddp = Fabric(accelerator="cpu", devices=2, strategy="ddp_fork").launch(
        load_and_step, str(out / "plain.pth"), True, str(out / "ddp_loaded.pth"))
    return out, weights, ddp


@pytest.mark.parametrize(("name", "devices", "before_optimizer"), [
    ("plain.pth", 2, False), ("fabric.pth", 3, True), ("model.safetensors", 3, False), ("model.safetensors", 2, True),
])
def test_load_raw_gives_the_files_weights_and_ddps_steps(files, tmp_path, name, devices, before_optimizer):
    out, weights, ddp_losses = files
    losses = zoff_fabric(devices).launch(load_and_step, str(out / name), before_optimizer, str(tmp_path / "w.pth"))
    loaded = torch.load(tmp_path / "w.pth")
    assert loaded.keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(loaded[key], value), key  # fp32 masters: the file's values, bit for bit
    if devices == 2:  # DDP's ranks split the batch the same way
        a, b = torch.tensor(losses, dtype=torch.float64), torch.tensor(ddp_losses, dtype=torch.float64)
        assert ((a - b).abs() / b.abs()).max() < 1e-5


def refused(fabric: Fabric, path: str, what: str) -> bool:
    fabric.seed_everything(7)
    module = FabricTiny()
    model = fabric.setup(module)
    optimizer = fabric.setup_optimizers(module.configure_optimizers())
    before = fabric.strategy.full_state_dict()
    try:
        fabric.load_raw(path, optimizer if what == "optimizer" else model)
    except (KeyError, ValueError) as err:
        after = fabric.strategy.full_state_dict()
        if any(not torch.equal(after[k], v) for k, v in before.items()):
            raise AssertionError("the refused load changed the model") from err
        raise
    return False


@pytest.mark.parametrize(("what", "kind", "message"), [
    ("names", KeyError, r"missing keys \['model.head.weight'\], unexpected keys \['model.lm_head.weight'\]"),
    ("shape", ValueError, (r"load_full_state_dict: shapes differ from the model's: \['model.head.weight: \[32, 32\]"
                           r" in the weights, \[64, 32\] in the model'\]")),
    ("optimizer", ValueError, r"strategy='zoff' keeps the optimizer's state in its own checkpoints"),
])
def test_wrong_weights_are_refused_before_anything_changes(files, tmp_path, what, kind, message):
    weights = dict(files[1])
    if what == "names":
        weights["model.lm_head.weight"] = weights.pop("model.head.weight")
    elif what == "shape":
        weights["model.head.weight"] = weights["model.head.weight"][:32]
    path = tmp_path / "weights.pth"
    torch.save(weights, path)
    with pytest.raises(kind, match=message):  # the rank's own exception, raised in the main process
        zoff_fabric(2).launch(refused, str(path), what)


def save_full(fabric: Fabric, path: str, reference: str) -> list[float]:
    """Two steps, then `fabric.save(path, {"model": model})` as LitGPT saves its final model; the fp32 weights
    gathered by zoff go to `reference`. Then a new model loads the file back with `fabric.load`: a sum of its head."""
    fabric.seed_everything(7)
    module = FabricTiny()
    model = fabric.setup(module)
    optimizer = fabric.setup_optimizers(module.configure_optimizers())
    for step in range(2):
        x, y = micro_batch(step, fabric.global_rank, fabric.world_size)
        fabric.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(path, {"model": model})
    weights = fabric.strategy.full_state_dict()
    if fabric.is_global_zero:
        torch.save(weights, reference)
    again = FabricTiny()
    model = fabric.setup(again)
    fabric.setup_optimizers(again.configure_optimizers())
    fabric.load(path, {"model": model})
    return [float(fabric.strategy.full_state_dict()["model.head.weight"].sum())]


def test_a_full_save_is_the_file_fabrics_fsdp_writes(tmp_path):
    path, reference = tmp_path / "lit_model.pth", tmp_path / "reference.pt"
    fabric = Fabric(accelerator="cpu", devices=2,
                    strategy=ZoffFabricStrategy(start_method="fork", state_dict_type="full"))
    (reloaded,) = fabric.launch(save_full, str(path), str(reference))
    assert path.is_file()
    saved = torch.load(path, weights_only=True)["model"]  # what LitGPT's tools read
    expected = torch.load(reference)
    assert saved.keys() == FabricTiny().state_dict().keys() == expected.keys()
    for name, value in saved.items():
        assert value.dtype == torch.float32
        assert torch.equal(value, expected[name]), name
    plain = FabricTiny()
    plain.load_state_dict(saved)  # without zoff
    assert reloaded == pytest.approx(float(expected["model.head.weight"].sum()))
