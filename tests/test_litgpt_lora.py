"""LitGPT's own `finetune/lora.py` (`litgpt.finetune.lora.main`, LitGPT's code) under
`Fabric(strategy=ZoffFabricStrategy(state_dict_type="full"))`, the one line its `setup` would change, against the same
under Fabric's DDP: 2 forked CPU ranks, fp32, accumulation over 2 micro-batches, a tiny checkpoint directory and a JSON
dataset made here.

What it takes of zoff: the model built under `fabric.init_module(empty_init=True)`, its base frozen before
`fabric.setup_module`, an optimizer over all its parameters, LitGPT's `load_checkpoint`, a plain
`model.load_state_dict(lazy_load(path), strict=False)` of base-model names that LitGPT's LoRA modules rename, the
validation at its interval (`fabric.all_reduce` of the loss), the throughput monitor, the adapters saved from
`model.state_dict()` (DTensors, `full_tensor()`) and merged into the base by `merge_lora`.

The base checkpoint holds the adapters' starting values too (lora_A drawn, lora_B zero), so both runs start from the
same adapters: under DDP `empty_init` leaves them uninitialised (`torch.empty`), under zoff each rank draws them as it
materialises its units."""

from __future__ import annotations

import sys
from pathlib import Path

import litgpt
import torch
from lightning.fabric import Fabric
from litgpt.args import EvalArgs
from litgpt.finetune import lora

from helpers import litgpt_files
from helpers.litgpt_files import TINY, VOCAB, checkpoint_dir, config, dataset, relative_difference, run_litgpt
from lightning_zoff import ZoffFabricStrategy

LORA = dict(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_value=True, lora_mlp=True)


def lora_config() -> litgpt.lora.Config:
    return litgpt.lora.Config.from_name("pythia-14m", **TINY, **LORA)


def base_weights() -> dict[str, torch.Tensor]:
    """The base model's weights by its own names, and the adapters' starting values by theirs."""
    torch.manual_seed(3)
    weights = litgpt.GPT(config()).state_dict()
    adapters = {k: v for k, v in litgpt.lora.GPT(lora_config()).state_dict().items() if "lora_" in k}
    assert adapters
    assert all(not v.any() for k, v in adapters.items() if k.endswith("lora_B"))
    return weights | adapters


def finetune(fabric: Fabric, base: str, data: str, out: str) -> list[float]:
    json_data, train = litgpt_files.instructions(data, max_steps=6)
    # LitGPT's sample at each evaluation runs on rank 0 alone, which no sharded model can serve (under LitGPT's own
    # ModelParallelStrategy too, rank 0 waits there forever): with more new tokens than the context, LitGPT skips it
    evaluation = EvalArgs(interval=3, max_new_tokens=1000, max_iters=2, initial_validation=False,
                          final_validation=False)
    optimizer = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.05}}
    return run_litgpt(fabric, lora.main, 2, 1337, lora_config(), json_data, Path(base), Path(out), train, evaluation,
                      optimizer, 1, "32-true")


def test_litgpts_finetune_lora_runs_with_its_strategy_line_changed(tmp_path, monkeypatch):
    base, data = checkpoint_dir(tmp_path, base_weights()), dataset(tmp_path)
    # the command line LitGPT's CLI would have parsed: `merge_lora` reads the LoRA settings back from what
    # `save_hyperparameters` writes of it
    options = [f"--{key}={value}" for key, value in LORA.items()]
    monkeypatch.setattr(sys, "argv", ["litgpt", "finetune_lora", str(base), *options, "--precision=32-true"])
    runs = {}
    for name, strategy in (("ddp", "ddp_fork"),
                           ("zoff", ZoffFabricStrategy(start_method="fork", state_dict_type="full"))):
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
        runs[name] = fabric.launch(finetune, str(base), str(data), str(tmp_path / name))
    assert len(runs["zoff"]) == len(runs["ddp"]) == 12 + 2  # 6 steps of 2 micro-batches, and 2 validations
    assert relative_difference(runs["zoff"], runs["ddp"]) < 1e-5
    assert runs["zoff"][-2] < runs["zoff"][0] - 0.5  # it learns, so the comparison means something
    # LitGPT's merged model (base + adapters), read as its tools read it, gives DDP's logits
    models = {}
    for name in runs:
        models[name] = litgpt.GPT(config())
        models[name].load_state_dict(torch.load(tmp_path / name / "final" / "lit_model.pth", weights_only=True))
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(models["zoff"](tokens), models["ddp"](tokens), rtol=1e-5, atol=1e-5)
    pretrained = torch.load(base / "lit_model.pth")["transformer.h.0.attn.qkv.weight"]
    assert not torch.equal(models["zoff"].transformer.h[0].attn.qkv.weight, pretrained)  # the adapters merged in
