"""What LitGPT's scripts read, made without a download: a checkpoint directory for a LitGPT config (its config, weights
drawn at random or given, a word-level tokenizer trained here on the prompt template's words and `WORDS`) and a local
JSON instruction set whose samples run to a given length. The tests (tests/helpers/litgpt_files.py) and the bench of
LitGPT's scripts (scripts/bench/bench_litgpt_scripts.py) make theirs here. Needs litgpt and tokenizers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

WORDS = ["red", "green", "blue", "cat", "dog", "fish", "one", "two", "three", "sun", "moon", "star"]


def checkpoint_dir(root: Path, config: object, weights: dict[str, torch.Tensor] | None = None,
                   dtype: torch.dtype = torch.float32, fast_init: bool = False) -> Path:
    """What `litgpt download` would leave for `config` (a `litgpt.Config`), under `root`: the model's config, its
    weights (`weights`, else a GPT of `config` drawn from seed 3 by its own initialisation, or with `fast_init` from
    N(0, 0.02) without building it on the CPU first, and stored in `dtype`) and the tokenizer."""
    import litgpt
    from litgpt.utils import save_config

    out = root / "base"
    out.mkdir(parents=True)
    save_config(config, out)
    if weights is None:
        torch.manual_seed(3)
        if fast_init:
            with torch.device("meta"):
                model = litgpt.GPT(config)
            model.to_empty(device="cpu")
            for param in model.parameters():
                param.data.normal_(0.0, 0.02)
        else:
            model = litgpt.GPT(config)
        weights = {name: t.to(dtype) for name, t in model.state_dict().items()}
    torch.save(weights, out / "lit_model.pth")
    write_tokenizer(out)
    return out


def write_tokenizer(out: Path) -> None:
    """A word-level tokenizer whose words are the Alpaca prompt template's and `WORDS`, with LitGPT's config files."""
    from litgpt.prompts import Alpaca
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    prompt = Alpaca().apply("repeat red", input="")  # the template's words get ids of their own
    tokenizer.train_from_iterator([prompt, *WORDS, "repeat"],
                                  trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps({**special, "tokenizer_class": "PreTrainedTokenizerFast"}))


def dataset(root: Path, words: int = 4, samples: int | None = None) -> Path:
    """Instructions "repeat a b" answered by `words` words from `WORDS` (seeded); the 48 pairs of the first four words
    when `samples` is None, else `samples` of them."""
    rng = random.Random(0)
    pairs = [(a, b) for a in WORDS for b in WORDS[:4]]
    if samples is not None:
        pairs = [pairs[i % len(pairs)] for i in range(samples)]
    items = []
    for a, b in pairs:
        answer = [a, b] * 2 if words == 4 else [rng.choice(WORDS) for _ in range(words)]
        items.append({"instruction": f"repeat {a} {b}", "input": "", "output": " ".join(answer)})
    path = root / "data.json"
    path.write_text(json.dumps(items))
    return path
