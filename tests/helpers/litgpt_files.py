"""What LitGPT's scripts read, made here without a download: a tiny model's checkpoint directory (config, weights, a
word-level tokenizer trained here) and a local JSON instruction set; and `run_litgpt`, which runs a LitGPT script's
`main` as its `setup` launches it with the losses it logs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import litgpt  # .ci/run installs it (pip install --no-deps 'litgpt==0.5.13')
import torch
from lightning.fabric import Fabric
from litgpt.args import TrainArgs
from litgpt.data import JSON
from litgpt.prompts import Alpaca

WORDS = ["red", "green", "blue", "cat", "dog", "fish", "one", "two", "three", "sun", "moon", "star"]
VOCAB = 128
TINY = dict(n_layer=2, n_embd=32, n_head=4, block_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB)


def config() -> litgpt.Config:
    return litgpt.Config.from_name("pythia-14m", **TINY)


def checkpoint_dir(root: Path, weights: dict[str, torch.Tensor] | None = None) -> Path:
    """What `litgpt download` would leave, made here: the model's config, its weights (`weights`, else a GPT of
    `config()` drawn from seed 3) and a tokenizer whose words are the prompt template's and `WORDS`."""
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    out = root / "tiny-gpt"
    out.mkdir()
    save_config(config(), out)
    if weights is None:
        torch.manual_seed(3)
        weights = litgpt.GPT(config()).state_dict()
    torch.save(weights, out / "lit_model.pth")
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    prompt = Alpaca().apply("repeat red", input="")  # the template's words get ids of their own
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


def instructions(data: str | Path, max_steps: int) -> tuple[JSON, TrainArgs]:
    """The JSON instruction set at `data` and the finetune scripts' loop over it for `max_steps` optimizer steps of 2
    micro-batches of one sample on each of 2 ranks."""
    train = TrainArgs(save_interval=None, log_interval=1, global_batch_size=4, micro_batch_size=1, lr_warmup_steps=1,
                      epochs=1, max_steps=max_steps, max_seq_length=64)
    return JSON(Path(data), val_split_fraction=0.25, num_workers=0), train


def run_litgpt(fabric: Fabric, main: Callable[..., Any], *args: Any, **kwargs: Any) -> list[float]:
    """LitGPT's `main(fabric, *args, **kwargs)` in the launched ranks; the losses it logs, in order (`fabric.log_dict`'s
    "loss": rank 0's mean over the accumulation window; "val_loss": the validation's, averaged over the ranks)."""
    losses: list[float] = []
    fabric.log_dict = lambda metrics, step=None: losses.extend(float(metrics[k]) for k in ("loss", "val_loss")
                                                               if k in metrics)
    main(fabric, *args, **kwargs)
    return losses


def relative_difference(a: list[float], b: list[float]) -> float:
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((x - y).abs() / y.abs()).max())
