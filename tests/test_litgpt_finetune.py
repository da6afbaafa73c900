"""LitGPT's own `finetune/full.py` (`litgpt.finetune.full.main`, LitGPT's code, not a copy) under
`Fabric(strategy=ZoffFabricStrategy(state_dict_type="full"))`, the one line its `setup` would change, against the same
under Fabric's DDP: a tiny LitGPT checkpoint directory made here (config, `lit_model.pth`, a word-level tokenizer
trained here), a local JSON dataset, 2 forked CPU ranks, accumulation over 2 micro-batches. The base model comes in
through `fabric.load_raw`, the fine-tuned one goes out through `fabric.save(path, {"model": model})`."""

from __future__ import annotations

import json
from pathlib import Path

import litgpt  # .ci/run installs it (pip install --no-deps 'litgpt==0.5.13')
import pytest
import torch
from lightning.fabric import Fabric
from litgpt.args import EvalArgs, TrainArgs
from litgpt.data import JSON
from litgpt.finetune import full

from lightning_zoff import ZoffFabricStrategy

pytestmark = pytest.mark.slow  # LitGPT's finetune script on 2 ranks

WORDS = ["red", "green", "blue", "cat", "dog", "fish", "one", "two", "three", "sun", "moon", "star"]


def config() -> litgpt.Config:
    return litgpt.Config.from_name("pythia-14m", n_layer=2, n_embd=32, n_head=4, block_size=64, vocab_size=128,
                                   padded_vocab_size=128)


def checkpoint_dir(root: Path) -> Path:
    """What `litgpt download` would leave, made here: the model's config and weights and a tokenizer."""
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    out = root / "tiny-gpt"
    out.mkdir()
    save_config(config(), out)
    torch.manual_seed(3)
    torch.save(litgpt.GPT(config()).state_dict(), out / "lit_model.pth")
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    prompt = full.Alpaca().prompt_style.apply("repeat red", input="")  # the template's words get ids of their own
    tokenizer.train_from_iterator([prompt, *WORDS, "repeat"],
                                  trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps({**special, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


def dataset(root: Path) -> Path:
    samples = [{"instruction": f"repeat {a} {b}", "input": "", "output": f"{a} {b} {a} {b}"}
               for a in WORDS for b in WORDS[:4]]
    path = root / "data.json"
    path.write_text(json.dumps(samples))
    return path


def finetune(fabric: Fabric, base: str, data: str, out: str) -> list[float]:
    """LitGPT's `main` as its `setup` launches it; the logged losses (each a mean over the accumulation window)."""
    losses: list[float] = []
    fabric.log_dict = lambda metrics, step=None: losses.append(float(metrics["loss"]))  # what LitGPT logs each iter
    train = TrainArgs(save_interval=None, log_interval=1, global_batch_size=4, micro_batch_size=1, lr_warmup_steps=1,
                      epochs=1, max_steps=4, max_seq_length=64)
    evaluation = EvalArgs(interval=1000, max_new_tokens=8, max_iters=1, initial_validation=False,
                          final_validation=False)
    json_data = JSON(Path(data), val_split_fraction=0.25, num_workers=0)
    full.main(fabric, 2, False, 1337, config(), json_data, Path(base), Path(out), train, evaluation, "AdamW")
    return losses


def test_litgpts_finetune_full_runs_with_its_strategy_line_changed(tmp_path, monkeypatch):
    # `save_hyperparameters` parses sys.argv as LitGPT's CLI would: pytest's arguments are not LitGPT's
    monkeypatch.setattr(full, "save_hyperparameters", lambda *args, **kwargs: None)
    base, data = checkpoint_dir(tmp_path), dataset(tmp_path)
    runs = {}
    for name, strategy in (("ddp", "ddp_fork"),
                           ("zoff", ZoffFabricStrategy(start_method="fork", state_dict_type="full"))):
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
        runs[name] = fabric.launch(finetune, str(base), str(data), str(tmp_path / name))
    zoff, ddp = torch.tensor(runs["zoff"], dtype=torch.float64), torch.tensor(runs["ddp"], dtype=torch.float64)
    assert len(zoff) == len(ddp) == 8  # 4 steps of 2 micro-batches
    assert ((zoff - ddp).abs() / ddp.abs()).max() < 1e-5
    # the fine-tuned model, one file, read as LitGPT's tools read it, gives DDP's outputs
    models = {}
    for name in runs:
        state = torch.load(tmp_path / name / "final" / "lit_model.pth", weights_only=True)
        models[name] = litgpt.GPT(config())
        models[name].load_state_dict(state.get("model", state))
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(models["zoff"](tokens), models["ddp"](tokens), rtol=1e-5, atol=1e-5)
    assert not torch.equal(models["zoff"].lm_head.weight, torch.load(base / "lit_model.pth")["lm_head.weight"])
