"""LoRA with Hugging Face peft under zoff: the adapters train as under DDP, the frozen base keeps its weights bit for
bit, the host holds optimizer state for the adapters only, and the plan says what a 7B-shaped model needs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from helpers.compare import rel_err
from helpers.tiny_module import read_probe
from lightning_zoff import ZoffStrategy
from lightning_zoff.placement import Machine, StateOptions, plan_memory
from lightning_zoff.placement.plan import host_bytes_per_element
from lightning_zoff.placement.rank import unit_shapes_before_sharding
from lightning_zoff.units import plan_units
from test_hf import Recorded, fit

pytest.importorskip("peft", reason="LoRA needs peft: pip install -e '.[lora]'")

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


def lora_llama() -> Recorded:
    torch.manual_seed(0)
    return Recorded("llama_tiny", lr=1e-2, lora=LORA)


@pytest.mark.slow
def test_lora_trains_the_adapters_as_ddp_and_leaves_the_base_as_it_was(tmp_path):
    initial = {name: p.detach().clone() for name, p in lora_llama().named_parameters()}
    _, ref = fit(tmp_path / "ddp", DDPStrategy(start_method="fork"), lora_llama())
    _, module = fit(tmp_path / "zoff", ZoffStrategy(start_method="fork", weights_to_main_process=True), lora_llama())
    zoff, ddp = read_probe(tmp_path / "zoff"), read_probe(tmp_path / "ddp")
    assert len(zoff["losses"]) == 12
    assert rel_err(zoff["losses"], ddp["losses"]) < 1e-5
    assert zoff["losses"][-1] < zoff["losses"][0] - 0.05  # the adapters learn
    trained = {name for name, p in module.named_parameters() if p.requires_grad}
    assert trained == {name for name in initial if ".lora_A." in name or ".lora_B." in name}
    state, ref_state = module.state_dict(), ref.state_dict()
    for name, before in initial.items():
        if name in trained:
            torch.testing.assert_close(state[name], ref_state[name], rtol=1e-4, atol=1e-5)
            assert not torch.equal(state[name], before), name
        else:
            assert torch.equal(state[name], before), name  # frozen: the very bits it started with


@pytest.mark.slow
def test_the_host_holds_state_for_the_adapters_only_as_the_plan_says(tmp_path):
    fit(tmp_path, ZoffStrategy(start_method="fork"), lora_llama(), max_steps=1)
    module = lora_llama()
    adapters = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert adapters < sum(p.numel() for p in module.parameters()) / 4
    for rank in (0, 1):
        info = read_probe(tmp_path, rank)
        memory = info["memory"]
        # fp32 masters of this rank's share of the adapters (each padded to a multiple of the 2 ranks) and no more
        assert adapters / 2 <= memory["host_master"] / 4 <= adapters / 2 * 1.05
        assert memory["host_optimizer_state"] == 2 * memory["host_master"]  # AdamW's two fp32 moments
        # the engine holds what the plan planned, byte for byte
        assert info["held"]["host"] == info["planned"]["host"] == memory["host_total"]
        # 32-true, windows of 2 micro-batches: 4 master + 8 moments + 4 window sum, the spare sets, and each unit's
        # landing for its 4-byte gradients (a roomy host: "auto" takes no shared staging ring)
        per_element = host_bytes_per_element(StateOptions(param_bytes=4, moment_bytes=4, moments=2, sum_bytes=4))
        assert per_element == 16
        assert memory["host_staging"] == memory["host_master"]
        assert memory["host_total"] == (per_element * memory["host_master"] // 4 + memory["host_spare_state"]
                                        + memory["host_staging"])


def planned_host_bytes(lora: dict | None) -> tuple[int, int, int]:
    """Trained elements and the plan's host bytes of Llama-2-7B's shape (hidden 4096, 32 blocks, intermediate 11008,
    vocab 32000) on one rank, bf16-mixed, AdamW with fp32 moments, no accumulation, all state on the host: without
    overlap, and with it (its spare sets, as many as a host with room holds); built on the meta device, so nothing
    is allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_zoff.examples.lora import add_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama"))
        if lora is not None:
            model = add_lora(model, lora)
    shapes, model_bytes = unit_shapes_before_sharding(model, plan_units(model), world_size=1, param_bytes=2)
    host = [plan_memory([s for s in shapes if s.trained],
                        StateOptions(param_bytes=2, moment_bytes=4, moments=2, sum_bytes=0, speculates=overlap),
                        Machine(2**50, None), "none", model_bytes=model_bytes).host_bytes for overlap in (False, True)]
    return sum(s.trained for s in shapes), *host


def test_the_guide_gives_the_plans_host_bytes_for_a_7b_model_with_lora():
    full = planned_host_bytes(None)
    lora = planned_host_bytes(dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "gate_proj", "up_proj", "down_proj"]))
    guide = GUIDE.read_text()
    for name, (trained, host, with_spares) in (("full fine-tuning", full), ("LoRA r=16, every linear layer", lora)):
        row = f"| {name} | {trained / 1e9:.3f}B | {host / 1e9:.2f} GB | {with_spares / 1e9:.2f} GB |"
        print(row)
        assert row in guide, row
    assert full[0] == 6_738_415_616  # Llama-2-7B's parameter count: the shape is the one named
    assert re.search(r"\| LoRA r=16, every linear layer \| 0\.040B \|", guide)
