"""Generation with a key-value cache (the GPT example and Hugging Face models) against full forwards, on one process
and under zoff on 2 ranks, and the host heap of no-grad forwards under zoff on the CPU."""

from __future__ import annotations

import ctypes
import functools
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import helpers.trainer
from lightning_zoff import ZoffStrategy
from lightning_zoff.examples.corpus import SyntheticDataModule
from lightning_zoff.examples.gpt import GPT, GPTConfig, GPTModule, draw_token
from lightning_zoff.examples.hf import HFCausalLM
from lightning_zoff.units import repeated_blocks

DRAWS = {"greedy": dict(top_k=1), "sampled": dict(temperature=0.8), "sampled_top_k": dict(temperature=1.3, top_k=20)}


def full_forward_generate(logits_of, idx: torch.Tensor, max_new_tokens: int, block_size: int, **draw) -> torch.Tensor:
    """The reference: every new token from a forward of the whole context (its last block_size tokens)."""
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = logits_of(idx[:, -block_size:])
            idx = torch.cat([idx, draw_token(logits[:, -1, :], **draw)], dim=1)
    return idx


def sharpened(module: nn.Module) -> nn.Module:
    """Larger weights than the init's: logits far from uniform, so that the greedy tokens vary and no two are near a
    tie (a cached forward rounds differently from a full one)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return module


def input_lengths(block: nn.Module) -> list[int]:
    """The sequence length of every call of `block`, recorded from now on."""
    lengths: list[int] = []

    def record(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        lengths.append(hidden.shape[1])

    block.register_forward_pre_hook(record, with_kwargs=True)
    return lengths


PROMPT_LEN, NEW_TOKENS, BLOCK_SIZE = 5, 20, 16
# what the first block runs: the prompt once, each new token alone until the 16 positions are full, then (the context
# shifting by a token a step) the whole context for each of the last 8 tokens, as without a cache
CACHED_LENGTHS = [5] + [1] * 11 + [16] * 8


@pytest.mark.parametrize("draw", DRAWS.values(), ids=DRAWS.keys())
def test_gpt_generate_with_cache_gives_the_tokens_of_full_forwards(draw):
    torch.manual_seed(0)
    model = sharpened(GPT(GPTConfig(block_size=BLOCK_SIZE, n_layer=2, n_head=2, n_embd=32))).eval()
    idx = torch.randint(256, (2, PROMPT_LEN))
    lengths = input_lengths(model.blocks[0])
    torch.manual_seed(1)
    out = model.generate(idx, NEW_TOKENS, **draw)
    assert lengths == CACHED_LENGTHS
    torch.manual_seed(1)
    assert torch.equal(out, full_forward_generate(lambda x: model(x)[0], idx, NEW_TOKENS, BLOCK_SIZE, **draw))


@pytest.mark.parametrize("draw", DRAWS.values(), ids=DRAWS.keys())
@pytest.mark.parametrize("preset", ["llama_tiny", "qwen3_tiny", "opt_tiny"])
def test_hf_generate_with_cache_gives_the_tokens_of_full_forwards(preset, draw):
    torch.manual_seed(0)
    module = sharpened(HFCausalLM(preset, block_size=BLOCK_SIZE)).eval()
    idx = torch.randint(256, (2, PROMPT_LEN))
    lengths = input_lengths(repeated_blocks(module)[0])
    torch.manual_seed(1)
    out = module.generate(idx, NEW_TOKENS, **draw)
    assert lengths == CACHED_LENGTHS
    torch.manual_seed(1)
    assert torch.equal(out, full_forward_generate(module, idx, NEW_TOKENS, BLOCK_SIZE, **draw))


# -- under zoff on 2 ranks --------------------------------------------------------------------------------------------

PROMPT, SAMPLE_TOKENS = b"def f(x):", 24


def fit(module: pl.LightningModule, callback: pl.Callback, **options) -> None:
    # the sample test reads the weights in the main process
    strategy = ZoffStrategy(start_method="fork", weights_to_main_process=True, **options)
    data = SyntheticDataModule(vocab_size=256, block_size=16, batch_size=2, num_samples=64)
    helpers.trainer.fit(module, data, strategy, max_steps=1, callbacks=[callback], limit_val_batches=0)


class Gathers:
    """Counts the forwards that found their FSDP2 unit sharded, that is the unit's all-gathers: FSDP2 registers a
    unit's DTensor shards as its parameters while it is sharded, the gathered tensors while not."""

    def __init__(self, model: nn.Module) -> None:
        self.count = 0
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                inner = [n for n, m in unit.named_modules() if m is not unit and isinstance(m, FSDPModule)]
                own = next(n for n, _ in unit.named_parameters() if not any(n.startswith(f"{i}.") for i in inner))
                unit.register_forward_pre_hook(functools.partial(self._check, own), prepend=True)

    def _check(self, name: str, unit: nn.Module, args) -> None:
        self.count += isinstance(unit.get_parameter(name), DTensor)


class SampleInRanks(pl.Callback):
    """After training, in every rank: the sample (cached, each unit gathered once), the reference from full forwards
    through the sharded model, and the all-gathers each ran, into `out/rank{r}.json`."""

    def __init__(self, out: Path, logits_of) -> None:
        self.out, self.logits_of = out, logits_of

    def on_train_end(self, trainer, module):
        module.eval()
        # a group of tied modules (the embedding and the head) is one unit with one state, gathered once
        gathers, units = Gathers(module), len({id(m._get_fsdp_state()) for m in module.modules()
                                               if isinstance(m, FSDPModule)})
        result = {"units": units}
        for kind, draw in DRAWS.items():
            torch.manual_seed(3)
            result[kind] = list(module.sample(PROMPT, SAMPLE_TOKENS, **draw))
            result[f"{kind}_gathers"], gathers.count = gathers.count, 0
            torch.manual_seed(3)
            prompt, logits_of = torch.tensor([list(PROMPT)]), lambda x: self.logits_of(module, x)
            reference = full_forward_generate(logits_of, prompt, SAMPLE_TOKENS, BLOCK_SIZE, **draw)
            result[f"{kind}_reference"] = reference[0].tolist()
            result[f"{kind}_reference_gathers"], gathers.count = gathers.count, 0
        # the sample gave the parameters back: the units are sharded again, and gathered for each forward again
        result["resharded"] = all(isinstance(p, DTensor) for p in module.parameters())
        with torch.no_grad():
            for _ in range(2):
                self.logits_of(module, torch.tensor([list(PROMPT)]))
        result["gathers_after"] = gathers.count
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


MODELS = {
    "gpt": (lambda: GPTModule(block_size=BLOCK_SIZE, n_layer=2, n_head=2, n_embd=32), lambda m, x: m.model(x)[0]),
    "qwen3_tiny": (lambda: HFCausalLM("qwen3_tiny", block_size=BLOCK_SIZE), lambda m, x: m(x)),
}


@pytest.mark.slow
@pytest.mark.parametrize(("model", "kept"), [("gpt", False), ("qwen3_tiny", False), ("gpt", True)])
def test_sample_under_zoff_gathers_once_and_gives_the_tokens_of_full_forwards(tmp_path, model, kept):
    """`kept`: units kept gathered from forward to backward in training (reshard_after_forward=False) still gather
    once for a sample, and each no-grad forward outside it gives the parameters back."""
    build, logits_of = MODELS[model]
    pl.seed_everything(0)
    module = sharpened(build())
    fit(module, SampleInRanks(tmp_path, logits_of), reshard_after_forward=not kept)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    result = ranks[0]
    units = result["units"]
    for kind, draw in DRAWS.items():
        # the prompt and 24 tokens in a context of 16: cached, then past the window too
        assert result[kind] == result[f"{kind}_reference"], kind
        assert result[f"{kind}_gathers"] == units  # each unit once for the whole sample
        assert result[f"{kind}_reference_gathers"] == units * SAMPLE_TOKENS  # each unit for every token
        # the main process got the trained weights back: one process, no sharding, the same tokens
        torch.manual_seed(3)
        assert list(module.eval().sample(PROMPT, SAMPLE_TOKENS, **draw)) == result[kind], kind
    assert result["resharded"]
    assert result["gathers_after"] == 2 * units
    assert len(set(result["sampled"])) > 4
    assert len(set(result["greedy"])) > 4  # tokens that vary: a real check


# -- no-grad forwards and the host heap --------------------------------------------------------------------------------

class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ["arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost"]]


def heap_bytes() -> int:
    """Bytes glibc's malloc holds in its heaps (in use or free, not the blocks it maps one by one)."""
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallInfo2
    return mallinfo2().arena


class HeapGrowth(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, module):
        module.eval()
        with torch.no_grad():
            for length in range(1, 9):  # warming up
                module(torch.randint(256, (2, length)))
            start = heap_bytes()
            for length in range(9, 65):  # a growing input, as a generation without a cache feeds
                module(torch.randint(256, (2, length)))
        (self.out / f"heap{trainer.global_rank}.json").write_text(json.dumps(heap_bytes() - start))


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc's mallinfo2 (2.33+) reads the heap")
def test_no_grad_forwards_under_zoff_do_not_grow_the_heap(tmp_path):
    # units of a few MB, which FSDP2 gathers and frees in every forward: with glibc's default threshold they come from
    # its heap after the first free, and the heap grows by 160-300 MB over these 56 forwards (about 2 MB with the
    # threshold that lightning_zoff.launch.malloc.fix_mmap_threshold keeps)
    fit(GPTModule(block_size=64, n_layer=2, n_head=4, n_embd=256), HeapGrowth(tmp_path))
    growth = [json.loads((tmp_path / f"heap{r}.json").read_text()) for r in (0, 1)]
    assert max(growth) < 16 * 2**20, growth
