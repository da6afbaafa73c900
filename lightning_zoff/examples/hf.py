"""Hugging Face transformers causal LMs (Llama, Qwen3, OPT, ...) trained like the GPT example: same data, loss and
optimizer groups. Needs `pip install -e '.[hf]'`.

Models are built from a config with random weights; nothing is downloaded. `model` names a preset below, a
transformers model type (`"llama"`, `"qwen3"`, `"opt"`, ...) or a local directory holding a `config.json`;
`config` changes or adds config values:

    HFCausalLM("qwen3_tiny")
    HFCausalLM("llama", config=dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, vocab_size=256))

As with `GPTModule`, the model is built in `__init__`. Under zoff, build a large one on the meta device:

    with trainer.init_module(empty_init=True):
        module = HFCausalLM("qwen3_4b")

Each rank then materialises and initialises only its own units, by the model's own `_init_weights` (which also
recomputes buffers such as the rotary `inv_freq`): see `lightning_zoff.sharding.default_param_init`.

`generate` and `sample` continue a sequence as `GPTModule`'s do (same arguments), so `scripts/train.py` samples either.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from typing_extensions import override

from lightning_zoff.examples.gpt import OptimizerFactory, decay_groups, draw_token, token_bytes
from lightning_zoff.examples.lora import add_lora
from lightning_zoff.ops.linear_cross_entropy import linear_cross_entropy
from lightning_zoff.sharding import keep_gathered

# name: (transformers model type, config values). The tiny ones use the corpus data module's byte vocabulary.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_tiny": ("llama", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )),
    "qwen3_tiny": ("qwen3", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
    )),
    "opt_tiny": ("opt", dict(
        vocab_size=256, hidden_size=64, word_embed_proj_dim=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256, dropout=0.0, tie_word_embeddings=True,
    )),
    # Qwen3-4B's shape: 4.02B parameters, the 389M-parameter embedding tied to the head
    "qwen3_4b": ("qwen3", dict(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=True,
    )),
    # Llama-3-8B's shape: 8.03B parameters, embedding and head apart (525M each)
    "llama3_8b": ("llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}, tie_word_embeddings=False,
    )),
    # Qwen2.5-7B's shape, from Qwen/Qwen2.5-7B-Instruct's config.json (the base model's differs in
    # max_position_embeddings only, which sizes no parameter: rotary): 7.62B parameters (7,615,616,512; the model card
    # says 7.61B, MegaTrain's TFLOP/s count 7.62e9), q/k/v with biases, embedding and head apart (545M each)
    "qwen25_7b": ("qwen2", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
    )),
    # Qwen3-14B's shape: 14.77B parameters, embedding and head apart (778M each)
    "qwen3_14b": ("qwen3", dict(
        vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
    )),
}


# model types whose causal LM forward hands the head's output on untouched (no soft-capping, scaling or slicing of the
# logits): their head may return the loss in the logits' place (`LossHead`)
PLAIN_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "opt"})


class LossHead(nn.Linear):
    """A causal LM's output layer that, while `targets` are set, returns the mean cross entropy of its logits against
    them instead of the logits (`linear_cross_entropy`: the vocabulary in slices, no batch x seq x vocab tensor).
    The loss goes through the model's own forward, so every hook on the model (FSDP2's gathers, DeepSpeed's) runs as
    for the logits; a checkpoint of it is an `nn.Linear`'s."""

    targets: torch.Tensor | None = None

    @override
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return super().forward(hidden)
        return linear_cross_entropy(hidden, self.weight, self.bias, self.targets)

    @classmethod
    def replacing(cls, head: nn.Linear) -> LossHead:
        """A `LossHead` holding `head`'s very parameters (ties to the embedding kept)."""
        loss_head = cls(head.in_features, head.out_features, bias=False, device="meta")
        loss_head.weight = head.weight
        loss_head.bias = head.bias
        return loss_head


def hf_config(model: str, config: dict[str, Any] | None = None) -> PretrainedConfig:
    """The transformers config of a preset, a model type or a local config directory, with `config` applied."""
    config = dict(config or {})
    if model in PRESETS:
        model_type, values = PRESETS[model]
        return AutoConfig.for_model(model_type, **{**values, **config})
    if Path(model).is_dir():
        loaded = AutoConfig.from_pretrained(model, local_files_only=True)
        loaded.update(config)
        return loaded
    try:
        return AutoConfig.for_model(model, **config)
    except ValueError as error:
        raise ValueError(f"HFCausalLM(model={model!r}): not a preset ({', '.join(PRESETS)}), a transformers model"
                         " type or a directory with a config.json") from error


class HFCausalLM(pl.LightningModule):
    """A transformers causal LM with its training loop. Batches are `(tokens, next tokens)` pairs, as the corpus and
    synthetic data modules give them; the loss is the mean cross entropy in fp32. `optimizer` builds the optimizer
    from two param groups (decay, no decay); without it, torch.optim.AdamW from `lr`, `weight_decay`, `betas`, `eps`.

    `vocab_size` (None: the preset's or config's) sets the config's value; `block_size` (None: the config's
    `max_position_embeddings`) is the longest context `generate` feeds the model. Both are `GPTModule`'s names, so the
    Hydra data configs read them from either model (`${model.block_size}`, `${model.vocab_size}`). `lora`: peft's
    `LoraConfig` arguments, to fine-tune LoRA adapters of the frozen model (`add_lora`).
    """

    def __init__(
        self,
        model: str = "llama_tiny",
        config: dict[str, Any] | None = None,
        vocab_size: int | None = None,
        block_size: int | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        attn_implementation: str = "sdpa",
        optimizer: OptimizerFactory | None = None,
        lora: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer or functools.partial(
            torch.optim.AdamW, lr=lr, betas=(betas[0], betas[1]), eps=eps, weight_decay=weight_decay
        )
        if vocab_size is not None:
            config = {**(config or {}), "vocab_size": vocab_size}
        self.model = AutoModelForCausalLM.from_config(hf_config(model, config), attn_implementation=attn_implementation)
        if lora is not None:
            self.model = add_lora(self.model, lora)
        head = self.model.get_output_embeddings()
        if self.model.config.model_type in PLAIN_HEAD_TYPES and type(head) is nn.Linear:
            self.model.set_output_embeddings(LossHead.replacing(head))
        self.block_size = block_size or self.model.config.max_position_embeddings

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The mean cross entropy in fp32 (bf16 logits would round the log-softmax); through the `LossHead` where the
        model has one, so the step never holds the batch's logits."""
        x, y = batch
        head = self.model.get_output_embeddings()
        if not isinstance(head, LossHead):
            return F.cross_entropy(self(x).float().flatten(0, 1), y.flatten())
        head.targets = y
        try:
            return self.model(input_ids=x, use_cache=False).logits  # the head's loss, in the logits' place
        finally:
            head.targets = None

    @override
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)

    @override
    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    @override
    def configure_optimizers(self):
        return self.optimizer_factory(decay_groups(self))

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Append `max_new_tokens` sampled tokens to `idx` (B, T) and return the longer sequence, as `GPT.generate`
        does: with the model's key-value cache each new token runs alone, until the sequence outgrows `block_size`;
        each step then runs the whole context (the last block_size tokens) again, as without a cache."""
        cache, new = None, idx[:, -self.block_size :]
        for _ in range(max_new_tokens):
            if cache is not None and cache.get_seq_length() == self.block_size:
                cache, new = None, idx[:, -self.block_size :]
            out = self.model(input_ids=new, cache=cache, use_cache=True)
            cache = out.cache
            new = draw_token(out.logits[:, -1, :], temperature, top_k)
            idx = torch.cat([idx, new], dim=1)
        return idx

    def sample(
        self, prompt: bytes, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> bytes:
        """Continue a byte string (its bytes are token ids 0-255, valid in any vocabulary of 256 or more); returns the
        prompt followed by `max_new_tokens` generated tokens as bytes (see `token_bytes`).

        With a sharded model every rank must call this together: the first forward all-gathers every unit, which
        then stays gathered until the sample is complete (see `keep_gathered`).
        """
        device = next(self.model.parameters()).device
        idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        with keep_gathered(self.model):
            out = self.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)
        return token_bytes(out[0].tolist())
