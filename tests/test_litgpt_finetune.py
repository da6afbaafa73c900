"""LitGPT's own `finetune/full.py` (`litgpt.finetune.full.main`, LitGPT's code, not a copy) under
`Fabric(strategy=ZoffFabricStrategy(state_dict_type="full"))`, the one line its `setup` would change, against the same
under Fabric's DDP: a tiny LitGPT checkpoint directory made here (config, `lit_model.pth`, a word-level tokenizer
trained here), a local JSON dataset, 2 forked CPU ranks, accumulation over 2 micro-batches. The base model comes in
through LitGPT's `load_checkpoint` (`model.load_state_dict` of a lazily read file, strict), the fine-tuned one goes out
through `fabric.save(path, {"model": model})`."""

from __future__ import annotations

from pathlib import Path

import litgpt  # .ci/run installs it (pip install --no-deps 'litgpt==0.5.13')
import pytest
import torch
from lightning.fabric import Fabric
from litgpt.args import EvalArgs
from litgpt.finetune import full

from helpers.litgpt_files import VOCAB, checkpoint_dir, config, dataset, instructions, relative_difference, run_litgpt
from lightning_zoff import ZoffFabricStrategy

pytestmark = pytest.mark.slow  # LitGPT's finetune script on 2 ranks


def finetune(fabric: Fabric, base: str, data: str, out: str) -> list[float]:
    """LitGPT's `main` as its `setup` launches it; the logged losses (each a mean over the accumulation window)."""
    json_data, train = instructions(data, max_steps=4)
    evaluation = EvalArgs(interval=1000, max_new_tokens=8, max_iters=1, initial_validation=False,
                          final_validation=False)
    return run_litgpt(fabric, full.main, 2, False, 1337, config(), json_data, Path(base), Path(out), train, evaluation,
                      "AdamW")


def test_litgpts_finetune_full_runs_with_its_strategy_line_changed(tmp_path, monkeypatch):
    # `save_hyperparameters` parses sys.argv as LitGPT's CLI would: pytest's arguments are not LitGPT's
    monkeypatch.setattr(full, "save_hyperparameters", lambda *args, **kwargs: None)
    base, data = checkpoint_dir(tmp_path), dataset(tmp_path)
    runs = {}
    for name, strategy in (("ddp", "ddp_fork"),
                           ("zoff", ZoffFabricStrategy(start_method="fork", state_dict_type="full"))):
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
        runs[name] = fabric.launch(finetune, str(base), str(data), str(tmp_path / name))
    assert len(runs["zoff"]) == len(runs["ddp"]) == 8  # 4 steps of 2 micro-batches
    assert relative_difference(runs["zoff"], runs["ddp"]) < 1e-5
    # the fine-tuned model, one file, read as LitGPT's tools read it, gives DDP's outputs
    models = {}
    for name in runs:
        state = torch.load(tmp_path / name / "final" / "lit_model.pth", weights_only=True)
        models[name] = litgpt.GPT(config())
        models[name].load_state_dict(state.get("model", state))
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(models["zoff"](tokens), models["ddp"](tokens), rtol=1e-5, atol=1e-5)
    assert not torch.equal(models["zoff"].lm_head.weight, torch.load(base / "lit_model.pth")["lm_head.weight"])
