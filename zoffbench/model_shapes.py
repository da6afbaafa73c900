"""The models the scripts take by name (`--model gpt13b`): the shapes of conf/model/*.yaml, the one place they are
written, and two test sizes for the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CONF_MODEL = Path(__file__).resolve().parents[1] / "conf" / "model"

# the models the scripts take by name: a conf/model option and the values that differ from it
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt1b": ("gpt_1b", {}),
    "gpt7b": ("gpt_7b", {"block_size": 1024}),  # gpt1b's sequence length
    "gpt13b": ("gpt_13b", {}),
    "gpt30b": ("gpt_30b", {}),
    "qwen3_4b": ("hf_qwen3_4b", {}),
    "llama3_8b": ("hf_llama3_8b", {}),  # seq 4096, as the option's
    "qwen3_14b": ("hf_qwen3_14b", {}),  # seq 4096, as the option's
    "qwen25_7b": ("hf_qwen25_7b", {}),  # seq 1024, MegaTrain's (the option's)
    "qwen3_tiny": ("hf_qwen3_tiny", {"block_size": 64}),
}
# sizes for a quick run on the CPU, which no conf/model option has
TEST_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64, bias=False),
    "small": dict(vocab_size=32000, block_size=512, n_layer=4, n_head=8, n_embd=512, bias=False),
}
MODEL_NAMES = tuple(sorted([*MODELS, *TEST_SHAPES]))


def model_shape(name: str) -> dict[str, Any]:
    """Model `name` as the scripts build it: a GPT's `GPTModule` keyword arguments, or a Hugging Face preset as
    {"hf": preset, "block_size": the sequence length}."""
    if name in TEST_SHAPES:
        return dict(TEST_SHAPES[name])
    option, changes = MODELS[name]
    return {**conf_model(option), **changes}


def conf_model(option: str) -> dict[str, Any]:
    """The model of conf/model/`option`.yaml: a GPT's `GPTModule` keyword arguments, or a Hugging Face preset as
    {"hf": preset, "block_size": the sequence length}."""
    import yaml  # Lightning's dependency

    config = yaml.safe_load((CONF_MODEL / f"{option}.yaml").read_text())
    if "_target_" not in config:  # an option of `@package _global_`: the model's keys are under `model:`
        config = config["model"]
    if config["_target_"].endswith(".HFCausalLM"):
        return {"hf": config["model"], "block_size": config["block_size"]}
    return {key: value for key, value in config.items() if key != "_target_"}
