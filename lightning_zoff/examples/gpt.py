"""A small GPT, readable top to bottom, and the LightningModule that trains it.

The model is plain PyTorch with no knowledge of sharding: the strategy applies FSDP2 to it from the
outside (one unit per `Block`), so `blocks` is a ModuleList of identical blocks on purpose.
"""

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from typing_extensions import override

from lightning_zoff.sharding import keep_gathered


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens
    block_size: int = 128  # longest context the position embedding covers
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers
    tie_weights: bool = False  # share tok_emb.weight with lm_head.weight


class KVCache:
    """The keys and values one attention layer has computed, so that generation runs each new token alone instead
    of the whole context again. Room for `size` positions, allocated at the first call in the activations' dtype."""

    def __init__(self, size: int):
        self.size = size
        self.length = 0  # positions cached
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache `k`, `v` (B, n_head, T, head_size) after the positions before; return the keys and values of all."""
        assert self.length == 0 or k.size(2) == 1, "a cache takes a whole context first, then one token at a time"
        if self.keys is None or self.values is None:
            self.keys = k.new_empty(k.size(0), k.size(1), self.size, k.size(3))
            self.values = torch.empty_like(self.keys)
        start, self.length = self.length, self.length + k.size(2)
        self.keys[:, :, start : self.length] = k
        self.values[:, :, start : self.length] = v
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    @override
    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.append(k, v)
        # a whole context attends causally; a single new token attends to every position cached before it
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=T > 1
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    @override
    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)initialize every weight; callable again after materializing a meta-device model."""
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def num_params(self) -> int:
        # parameters() yields a tied weight once, so it is counted once
        return sum(p.numel() for p in self.parameters())

    @override
    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, caches: list[KVCache] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) and, given `targets`, the loss. With `caches` (one per block, for generation): `idx`
        continues the positions cached, and only the last position's logits (B, 1, vocab) are computed."""
        B, T = idx.shape
        start = caches[0].length if caches is not None else 0
        assert start + T <= self.config.block_size, f"{start + T} positions, block_size is {self.config.block_size}"
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        if caches is not None:
            x = x[:, -1:]  # the next token needs no other position's logits
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            # float32 so that bf16 logits do not round the log-softmax
            loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Append `max_new_tokens` sampled tokens to `idx` (B, T) and return the longer sequence.

        The keys and values are cached, so each new token runs the model on itself alone. Once the sequence outgrows
        block_size, the context (its last block_size tokens) shifts by a token per step and every position's
        embedding changes: each step then runs the whole context again, as without a cache."""
        block_size = self.config.block_size
        caches = [KVCache(block_size) for _ in self.blocks]
        new = idx[:, -block_size:]
        for _ in range(max_new_tokens):
            if caches[0].length == block_size:
                for cache in caches:
                    cache.length = 0
                new = idx[:, -block_size:]
            logits, _ = self(new, caches=caches)
            new = draw_token(logits[:, -1, :], temperature, top_k)
            idx = torch.cat([idx, new], dim=1)
        return idx


def draw_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None) -> torch.Tensor:
    """One token per row of `logits` (B, vocab), drawn from the softmax at `temperature` over the `top_k` most likely
    tokens (all of them when None): (B, 1) ids. `HFCausalLM.generate` draws with it too."""
    logits = logits.float() / temperature
    if top_k is not None:
        kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth_largest, -math.inf)
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


def decay_groups(module: nn.Module) -> list[dict]:
    """Two param groups: weight matrices (decayed) and the rest (biases, norms, embeddings: weight_decay=0).
    Embeddings are 2-D but act as lookup tables: decaying them only shrinks rare tokens (a head tied to the token
    embedding counts as an embedding)."""
    embedding_params = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in module.parameters():
        if not p.requires_grad:
            continue
        is_matrix = p.dim() >= 2 and id(p) not in embedding_params
        (decay if is_matrix else no_decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


# Builds the optimizer from param groups: `functools.partial(torch.optim.AdamW, lr=...)`, Hydra's `_partial_: true`
# or LightningCLI's `class_path` + `init_args` all give one.
OptimizerFactory = Callable[[Iterable], torch.optim.Optimizer]


class GPTModule(pl.LightningModule):
    """The GPT with its training loop. `optimizer` builds the optimizer from two param groups (decay, no decay: the
    second sets weight_decay=0); without it, torch.optim.AdamW from `lr`, `weight_decay`, `betas` and `eps`."""

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = False,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        lr_step_size: int = 0,  # > 0: multiply the lr by lr_gamma every lr_step_size optimizer steps
        lr_gamma: float = 0.5,
        optimizer: OptimizerFactory | None = None,
    ):
        super().__init__()
        # a factory is code, not a hyperparameter: checkpoints must load without it
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer or functools.partial(
            torch.optim.AdamW, lr=lr, betas=(betas[0], betas[1]), eps=eps, weight_decay=weight_decay
        )
        self.model = GPT(
            GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias, tie_weights)
        )

    def init_module_weights(self, module: nn.Module) -> None:
        """The GPT's own init for one module: what zoff calls on each module it materialises from the meta device
        (`trainer.init_module(empty_init=True)`), where torch's defaults would otherwise apply."""
        GPT._init_weights(module)

    @override
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        return self.model(idx, targets)

    @override
    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    @override
    def test_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("test_loss", loss, sync_dist=True)

    @override
    def predict_step(self, batch, batch_idx):
        """The most likely next token after every position: (B, T) ids."""
        logits, _ = self.model(batch[0])
        return logits.argmax(dim=-1)

    @override
    def configure_optimizers(self):
        # Runs after the strategy has sharded the model, so look parameters up now, not in __init__.
        optimizer = self.optimizer_factory(decay_groups(self))
        hp = self.hparams
        if hp["lr_step_size"] <= 0:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=hp["lr_step_size"], gamma=hp["lr_gamma"])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def sample(
        self, prompt: bytes, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> bytes:
        """Continue a byte string; returns the prompt followed by `max_new_tokens` generated bytes.

        With a sharded model every rank must call this together: the first forward all-gathers every unit, which
        then stays gathered until the sample is complete (see `keep_gathered`).
        """
        device = next(self.model.parameters()).device
        idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        with keep_gathered(self.model):
            out = self.model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)
        return token_bytes(out[0].tolist())


def token_bytes(ids: list[int]) -> bytes:
    """Byte tokens as bytes. An id past 255 (a vocabulary larger than the data's bytes, barely trained) is no byte:
    it becomes U+FFFD in UTF-8."""
    return b"".join(bytes([i]) if i < 256 else "\ufffd".encode() for i in ids)
