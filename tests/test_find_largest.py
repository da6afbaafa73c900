"""scripts/checks/find_largest.py predicts the largest GPT from zoff's own plan and traced step: the prediction trains
under the Trainer's setup and one layer more is refused there, in one line (a CPU standing in for a GPU of a given
size: the plan's arithmetic is the GPU's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from helpers.trainer import fit
from lightning_zoff import ZoffStrategy
from lightning_zoff.examples.gpt import GPTModule
from lightning_zoff.placement import Machine, PlanDoesNotFit, rank as rank_memory
from lightning_zoff.placement.machine import GiB
from lightning_zoff.placement.step_costs import Rates
from zoffbench.data import RandomTokens
from zoffbench.model_shapes import model_shape

ROOT = Path(__file__).resolve().parents[1]
HOST = 10**11  # what both plans read of the host: plenty
BATCH = 2
GPU_RATES = Rates(accelerator_flops_per_s=7e14, host_s_per_element=3e-10)


def find_largest():
    spec = importlib.util.spec_from_file_location("find_largest", ROOT / "scripts" / "checks" / "find_largest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def setup_of(tmp_path, monkeypatch, cfg: dict, layers: int, capacity: int) -> None:
    """The Trainer's setup and one step of the GPT at `layers`, on a machine of `capacity` bytes of GPU."""
    monkeypatch.setattr(rank_memory, "measure_machine",
                        lambda group, loader_workers=0: Machine(HOST, capacity, loader_workers))
    # a GPU's rates (an H100's bf16 product, 16 cores' update), not this CPU's: recompute is the cheaper there at one
    # micro-batch a step, as find_largest assumes ("auto" recomputes all the blocks at the sizes it searches)
    monkeypatch.setattr(rank_memory, "measure_rates", lambda device, moment_dtype, host_rate: GPU_RATES)
    tmp_path.mkdir()
    monkeypatch.chdir(tmp_path)
    data = RandomTokens(vocab_size=cfg["vocab_size"], seq=cfg["block_size"], batch=BATCH, length=4)
    module = GPTModule(**{**cfg, "n_layer": layers})
    fit(module, data, ZoffStrategy(start_method="fork"), devices=1, max_steps=1, precision="bf16-mixed")


@pytest.mark.slow
def test_the_prediction_trains_and_one_layer_more_is_refused_at_setup(tmp_path, monkeypatch):
    script = find_largest()
    cfg = model_shape("tiny")
    step = script.traced_step(cfg, 4, BATCH, torch.device("cpu"))
    capacity = GiB + 10 * step.total  # room for a few layers beside the slack
    predicted = script.predict_layers(cfg, BATCH, 4, HOST, capacity, torch.device("cpu"))
    assert 1 < predicted < 399
    setup_of(tmp_path / "fits", monkeypatch, cfg, predicted, capacity)
    with pytest.raises(PlanDoesNotFit, match=r"needed at the step's peak"):
        setup_of(tmp_path / "above", monkeypatch, cfg, predicted + 1, capacity)


def test_the_gpu_is_read_through_a_device_without_an_index(monkeypatch):
    """find_largest's child reads `torch.device("cuda")`: torch's per-process fraction takes only an indexed device
    (on the H100, 2026-12-07, it raised there), so the reading resolves the current device first."""
    from lightning_zoff.placement.machine import accelerator_capacity

    def fraction(device):
        if torch.device(device).index is None:
            raise ValueError("Expected a torch.device with a specified index or an integer")
        return 0.5

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2 * GiB)
    assert accelerator_capacity(torch.device("cuda")) == 40 * GiB  # the fraction's cap below free + reserved
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    assert accelerator_capacity(torch.device("cuda")) == 72 * GiB
