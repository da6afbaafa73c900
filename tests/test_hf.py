"""Hugging Face transformers causal LMs under zoff: training on 2 ranks against DDP, tied embeddings, models built on
the meta device with the model's own init (buffers included), and pretrained weights loaded into the shards."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import helpers.trainer
from helpers.compare import rel_err
from helpers.nanogpt import NanoGPT
from helpers.resume_run import SaveBatch
from helpers.tiny_module import read_probe
from lightning_zoff import ZoffStrategy
from lightning_zoff.examples.corpus import CorpusDataModule
from lightning_zoff.examples.gpt import GPTModule, token_bytes
from lightning_zoff.examples.hf import PRESETS, HFCausalLM, hf_config
from lightning_zoff.sharding import default_param_init, materialize
from lightning_zoff.units import forward_order, plan_units

TINY = ["llama_tiny", "qwen3_tiny", "opt_tiny"]
EMBED, HEAD = "model.model.embed_tokens.weight", "model.lm_head.weight"  # Llama and Qwen3 names


class Recorded(HFCausalLM):
    """Keeps every micro-batch's loss for `Probe`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


def corpus() -> CorpusDataModule:
    return CorpusDataModule(block_size=32, batch_size=4, max_bytes=100_000)


def fit(out: Path, strategy, module: pl.LightningModule | None = None, *, max_steps: int = 6, accumulate: int = 2,
        callbacks=(), trainer_hook=None) -> tuple[pl.Trainer, pl.LightningModule]:
    """2 ranks, 32-true, clipping; `trainer_hook(trainer)` builds the module when given."""
    pl.seed_everything(7)
    trainer = helpers.trainer.fit(module if module is not None else trainer_hook, corpus(), strategy, out=out,
                                  max_steps=max_steps, accumulate=accumulate, clip=1.0, callbacks=callbacks,
                                  limit_val_batches=0)
    return trainer, trainer.lightning_module


# -- building on the meta device: the model's own init, buffers recomputed, ties kept -----------------------------

def init_statistics_match(built: nn.Module, meta_built: nn.Module, std: float) -> None:
    """Same init distribution per tensor: constant tensors (norms, biases) equal, random ones N(0, std)."""
    reference = built.state_dict()
    for name, value in meta_built.state_dict().items():
        expected = reference[name]
        assert value.shape == expected.shape, name
        assert value.dtype == expected.dtype, name
        if expected.numel() > 1 and expected.std() > 0:
            assert value.std().item() == pytest.approx(std, rel=0.1), name
            assert expected.std().item() == pytest.approx(std, rel=0.1), name  # the reference draws the same
            assert abs(value.mean().item()) < 4 * std / math.sqrt(value.numel()), name
        else:
            assert torch.equal(value, expected), name


@pytest.mark.parametrize("preset", TINY)
def test_meta_built_hf_model_gets_its_own_init_and_buffers(preset):
    torch.manual_seed(0)
    built = HFCausalLM(preset)
    with torch.device("meta"):
        meta_built = HFCausalLM(preset)
    materialize(meta_built, default_param_init(meta_built))
    # non-persistent buffers (the rotary inv_freq) are not in the state dict: compared on their own, bit for bit
    buffers = dict(built.named_buffers())
    assert buffers.keys() == dict(meta_built.named_buffers()).keys()
    for name, buffer in meta_built.named_buffers():
        assert buffer.device.type == "cpu", name
        assert torch.equal(buffer, buffers[name]), name
    config = built.model.config
    init_statistics_match(built, meta_built, std=getattr(config, "initializer_range", None) or config.init_std)
    tied = built.model.config.tie_word_embeddings
    head, embed = meta_built.model.get_output_embeddings().weight, meta_built.model.get_input_embeddings().weight
    assert (head is embed) == tied
    assert isinstance(head, nn.Parameter)
    assert sum(p.numel() for p in meta_built.parameters()) == sum(p.numel() for p in built.parameters())


def test_meta_built_gpt_gets_the_gpts_init():
    # statistics, not bits: the meta path initialises unit by unit, so the RNG runs in another order
    kwargs = dict(block_size=32, n_layer=2, n_head=2, n_embd=64)
    torch.manual_seed(0)
    built = GPTModule(**kwargs)
    with torch.device("meta"):
        meta_built = GPTModule(**kwargs)
    materialize(meta_built, default_param_init(meta_built))  # GPTModule.init_module_weights: N(0, 0.02)
    init_statistics_match(built, meta_built, std=0.02)
    # without the hook, torch's defaults: Linear's kaiming-uniform, std 1/sqrt(3 * fan_in) = 0.072 here
    with torch.device("meta"):
        plain = GPTModule(**kwargs)
    materialize(plain, lambda module: module.reset_parameters())
    assert plain.model.blocks[0].mlp.fc.weight.std().item() == pytest.approx(1 / math.sqrt(3 * 64), rel=0.1)


def test_a_tied_group_built_on_meta_is_materialised_as_one_parameter():
    with torch.device("meta"):
        model = NanoGPT(tie=True)
    wte, head = model.transformer.wte, model.lm_head
    materialize(model, lambda module: module.reset_parameters(), under=(wte, head))  # one unit: both at once
    assert head.weight is wte.weight
    assert not head.weight.is_meta
    assert not head.weight.isnan().any()
    assert model.transformer.wpe.weight.is_meta  # outside the unit: left for its own unit


class Scale(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.register_buffer("table", torch.arange(n, dtype=torch.float32))  # computed in __init__

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def test_meta_materialisation_refusals():
    with torch.device("meta"):
        scale = Scale(4)
    # reset_parameters() of a module that is not torch's own may not recompute the buffers built in __init__
    with pytest.raises(RuntimeError, match=r"table was built on the meta device and its initialisation .* left it"
                                           r" unset.*a buffer computed in __init__ is lost on the meta device"):
        materialize(scale, default_param_init(scale))
    with torch.device("meta"):
        scale = Scale(4)
    # an init that misses a tensor: named, instead of training from uninitialised memory
    with pytest.raises(RuntimeError, match=r"table was built on the meta device and its initialisation .* left it"
                                           r" unset"):
        materialize(scale, lambda module: module.reset_parameters())
    with torch.device("meta"):
        scale = Scale(4)
    materialize(scale, lambda module: (module.reset_parameters(), module.table.copy_(torch.arange(4.0))))
    assert torch.equal(scale.table, torch.arange(4.0))
    assert torch.equal(scale.weight, torch.ones(4))


class Rotary(nn.Module):
    """As LitGPT's GPT: a buffer built in __init__, which reset_parameters() replaces with a new tensor."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.register_buffer("cos", torch.arange(n, dtype=torch.float32).cos(), persistent=False)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        self.cos = torch.arange(self.weight.numel(), dtype=torch.float32).cos()


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def test_meta_materialisation_checks_the_tensors_init_left_in_place():
    with torch.device("meta"):
        rotary = Rotary(4)
    materialize(rotary, default_param_init(rotary))  # the NaN tensor it replaced is not checked, the new one is
    assert torch.equal(rotary.cos, torch.arange(4, dtype=torch.float32).cos())
    with torch.device("meta"):
        counter = Counter()
    # an integer buffer left unset cannot be told from a set one: refused unless an init hook says how to set it
    with pytest.raises(TypeError, match=r"Counter was built on the meta device .* holds integer buffers"):
        materialize(counter, default_param_init(counter))
    with torch.device("meta"):
        counter = Counter()
    materialize(counter, lambda module: (module.reset_parameters(), module.seen.zero_()))
    assert counter.seen.item() == 0


def test_the_embedding_norm_and_head_of_a_hugging_face_model_are_units_of_their_own():
    module = HFCausalLM("llama_tiny", config={"tie_word_embeddings": False})
    units = plan_units(module)
    hf = module.model
    assert [(unit.name, unit.modules) for unit in units] == [
        ("model.model.layers.0", (hf.model.layers[0],)), ("model.model.layers.1", (hf.model.layers[1],)),
        ("model.model.embed_tokens", (hf.model.embed_tokens,)), ("model.model.norm", (hf.model.norm,)),
        ("model.lm_head", (hf.lm_head,))]
    assert forward_order(module, units) == ["model.model.embed_tokens", "model.model.layers.0", "model.model.layers.1",
                                            "model.model.norm", "model.lm_head"]
    # a transformers model holding a parameter itself is a unit, as any module with a forward: only its forward
    # could gather that parameter
    hf.register_parameter("scale", nn.Parameter(torch.ones(2)))
    assert [unit.name for unit in plan_units(module)] == ["model.model.layers.0", "model.model.layers.1", "model"]


def test_tied_parameters_stay_in_one_unit():
    tied = HFCausalLM("qwen3_tiny")
    layer = type(tied.model.model.layers[0])
    # asked for the embedding as a block of its own: it shares its weight with the head, so it is no block; the
    # Hugging Face models are walked into, and the embedding and the head are one unit, the final norm another
    units = plan_units(tied, {layer, nn.Embedding})
    assert [unit.name for unit in units] == ["model.model.layers.0", "model.model.layers.1",
                                             "model.model.embed_tokens+model.lm_head", "model.model.norm"]
    assert units[2].modules == (tied.model.model.embed_tokens, tied.model.lm_head)
    untied = HFCausalLM("qwen3_tiny", config={"tie_word_embeddings": False})
    assert "model.model.embed_tokens" in [unit.name for unit in plan_units(untied, {layer, nn.Embedding})]


def test_presets_and_optimizer_groups():
    config = hf_config("qwen3_4b")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == (
            2560, 36, 32, 8, 128, 9728, 151936, True)
    with torch.device("meta"):  # shapes only
        qwen3_4b = HFCausalLM("qwen3_4b")
    assert 4.0e9 < sum(p.numel() for p in qwen3_4b.parameters()) < 4.05e9
    assert set(PRESETS) >= {"llama_tiny", "qwen3_tiny", "opt_tiny", "qwen3_4b"}
    module = HFCausalLM("qwen3_tiny", lr=2e-3)
    decay, no_decay = module.configure_optimizers().param_groups
    assert decay["lr"] == 2e-3
    assert no_decay["weight_decay"] == 0.0
    # the head is the embedding (tied): a lookup table, not decayed; norms are not decayed either
    assert id(module.model.lm_head.weight) in {id(p) for p in no_decay["params"]}
    assert all(p.dim() == 2 for p in decay["params"])
    with pytest.raises(ValueError, match=r"not a preset .*qwen3_tiny"):
        hf_config("no_such_model")
    wide = HFCausalLM("qwen3_tiny", config={"vocab_size": 300}, vocab_size=512)  # the argument wins
    assert wide.model.config.vocab_size == 512
    assert wide.model.model.embed_tokens.weight.shape == (512, 64)
    assert (wide.block_size, HFCausalLM("qwen3_tiny", block_size=128).block_size) == (256, 128)  # 256: max positions


def test_generate_is_greedy_search_at_top_k_1_and_sample_gives_bytes():
    torch.manual_seed(0)
    module = HFCausalLM("qwen3_tiny", block_size=64).eval()
    with torch.no_grad():  # larger weights than the init's, so that the greedy tokens vary
        for p in module.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    idx = torch.tensor([list(b"import ")])
    # transformers' own greedy search (with its KV cache) gives the same tokens as our loop of full forwards
    greedy = module.model.generate(idx, max_new_tokens=24, do_sample=False)
    assert torch.equal(module.generate(idx, 24, top_k=1), greedy)
    module.block_size = 8
    out = module.sample(b"def ", 20, top_k=10)  # longer than block_size: the context is cropped
    assert isinstance(out, bytes)
    assert out.startswith(b"def ")
    assert len(out) == 24
    # ids past the bytes (qwen3_4b's vocabulary, barely trained) print as U+FFFD
    assert token_bytes([100, 255, 256, 151935]) == b"d\xff" + "\ufffd".encode() * 2
    wide = HFCausalLM("qwen3_tiny", vocab_size=4096).sample(b"x", 8)  # near uniform: most of its ids are no byte
    assert wide.startswith(b"x")
    assert "\ufffd".encode() in wide


# -- training on 2 ranks ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_llama_trains_on_two_ranks_like_ddp(tmp_path):
    # untied: the embedding, the final norm and the head are units of their own beside the layers
    ref_out, zoff_out = tmp_path / "ddp", tmp_path / "zoff"
    def built():
        torch.manual_seed(0)  # the same initial weights for both
        return Recorded("llama_tiny", lr=3e-3)

    fit(ref_out, DDPStrategy(start_method="fork"), built(), max_steps=10)
    _, module = fit(zoff_out, ZoffStrategy(start_method="fork"), built(), max_steps=10)
    losses = read_probe(zoff_out)["losses"]
    assert len(losses) == 20
    assert rel_err(losses, read_probe(ref_out)["losses"]) < 1e-5
    assert abs(losses[0] - math.log(256)) < 0.3  # near-uniform predictions at the start
    assert sum(losses[-4:]) / 4 < losses[0] - 1.0
    assert not module.model.config.tie_word_embeddings


class TieCheck(pl.Callback):
    """After training, in every rank: are the gathered embedding and head (fp32 masters) the same values?"""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        zoff = isinstance(trainer.strategy, ZoffStrategy)
        state = trainer.strategy.full_state_dict() if zoff else pl_module.state_dict()
        (self.out / f"tie{trainer.global_rank}.json").write_text(json.dumps(torch.equal(state[EMBED], state[HEAD])))


@pytest.mark.slow
def test_tied_embeddings_train_like_ddp_and_stay_tied(tmp_path):
    ref_out, zoff_out = tmp_path / "ddp", tmp_path / "zoff"
    _, ref = fit(ref_out, DDPStrategy(start_method="fork"), Recorded("qwen3_tiny", lr=3e-3))
    _, module = fit(zoff_out, ZoffStrategy(start_method="fork", weights_to_main_process=True),
                    Recorded("qwen3_tiny", lr=3e-3), callbacks=[TieCheck(zoff_out)])
    zoff, ddp = read_probe(zoff_out), read_probe(ref_out)
    assert len(zoff["losses"]) == 12
    assert rel_err(zoff["losses"], ddp["losses"]) < 1e-5
    assert zoff["losses"][-1] < zoff["losses"][0] - 0.5
    # held and updated once: the ranks' shards add up to the deduplicated parameter count
    ranks = [zoff, read_probe(zoff_out, 1)]
    params = sum(p.numel() for p in module.parameters())
    assert sum(r["memory"]["local_params"] for r in ranks) == zoff["num_params"] == params
    assert all(json.loads((zoff_out / f"tie{r}.json").read_text()) for r in (0, 1))
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight
    ref_state = ref.state_dict()
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], rtol=1e-4, atol=1e-5)


class BufferCheck(pl.Callback):
    """In every rank at the start of fit: the model's buffers against a model built on the CPU the ordinary way."""

    def __init__(self, out: Path, preset: str) -> None:
        self.out, self.preset = out, preset

    def on_fit_start(self, trainer, pl_module):
        reference = dict(HFCausalLM(self.preset).named_buffers())
        same = {name: torch.equal(b.cpu(), reference[name]) for name, b in pl_module.named_buffers()}
        (self.out / f"buffers{trainer.global_rank}.json").write_text(json.dumps(same))


@pytest.mark.slow
def test_meta_built_hf_model_trains_on_two_ranks(tmp_path):
    def build_on_meta(trainer):
        with trainer.init_module(empty_init=True):
            module = Recorded("qwen3_tiny", lr=3e-3)
        assert all(t.is_meta for t in [*module.parameters(), *module.buffers()])  # nothing allocated here
        return module

    _, module = fit(tmp_path, ZoffStrategy(start_method="fork", weights_to_main_process=True),
                    trainer_hook=build_on_meta, max_steps=10,
                    callbacks=[BufferCheck(tmp_path, "qwen3_tiny")])
    for rank in (0, 1):
        same = json.loads((tmp_path / f"buffers{rank}.json").read_text())
        assert set(same) == {"model.model.rotary_emb.inv_freq", "model.model.rotary_emb.original_inv_freq"}
        assert all(same.values())
    built = tmp_path / "built"  # the same run from a model built on the CPU: another draw of the same init
    fit(built, ZoffStrategy(start_method="fork"), Recorded("qwen3_tiny", lr=3e-3), max_steps=10)
    losses, reference = read_probe(tmp_path)["losses"], read_probe(built)["losses"]
    assert abs(losses[0] - reference[0]) < 0.15
    assert abs(losses[0] - math.log(256)) < 1.0
    assert sum(losses[-4:]) / 4 < losses[0] - 1.0
    # the main process's model, which never had memory, got the trained weights, tied as built
    assert not any(p.is_meta for p in module.parameters())
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight


# -- pretrained weights into the shards ---------------------------------------------------------------------------

class LoadAtStart(pl.Callback):
    def __init__(self, path: Path, pretrained: dict, out: Path):
        self.path, self.pretrained, self.out = path, pretrained, out

    def on_fit_start(self, trainer, pl_module):
        trainer.strategy.load_full_state_dict(self.path)
        gathered = trainer.strategy.full_state_dict()
        same = all(torch.equal(gathered[k], v) for k, v in self.pretrained.items())
        (self.out / f"same{trainer.global_rank}.json").write_text(json.dumps(same))


def test_pretrained_hf_weights_give_the_full_models_loss(tmp_path):
    pl.seed_everything(123)
    pretrained = HFCausalLM("qwen3_tiny")
    state = pretrained.state_dict()
    path = tmp_path / "pretrained.pt"
    # as Hugging Face checkpoints do, keep one name of the tied pair: the head comes with the embedding
    torch.save({k: v for k, v in state.items() if k != HEAD}, path)
    fit(tmp_path, ZoffStrategy(start_method="fork"), Recorded("qwen3_tiny"), max_steps=1, accumulate=1,
        callbacks=[LoadAtStart(path, state, tmp_path), SaveBatch(0, tmp_path)])
    # the model was built from another seed; after the load, its masters are the pretrained weights bit for bit
    assert all(json.loads((tmp_path / f"same{r}.json").read_text()) for r in (0, 1))
    x, y = torch.load(tmp_path / "batch0.pt")
    with torch.no_grad():
        expected = F.cross_entropy(pretrained(x).flatten(0, 1), y.flatten()).item()
    assert read_probe(tmp_path)["losses"][0] == pytest.approx(expected, rel=1e-6)


class LoadEach(pl.Callback):
    """At the start of fit, in every rank: load each `(source, kwargs, weights)` in turn and note whether the gathered
    masters are then those weights bit for bit, or the ValueError's message."""

    def __init__(self, loads: list, out: Path) -> None:
        self.loads, self.out = loads, out

    def on_fit_start(self, trainer, pl_module):
        results = []
        for source, kwargs, weights in self.loads:
            try:
                trainer.strategy.load_full_state_dict(source, **kwargs)
            except ValueError as err:
                results.append(str(err))
                continue
            gathered = trainer.strategy.full_state_dict()
            same = gathered.keys() == weights.keys() and all(torch.equal(gathered[k], v) for k, v in weights.items())
            results.append(same)
        (self.out / f"loads{trainer.global_rank}.json").write_text(json.dumps(results))


@pytest.mark.parametrize("preset", ["llama_tiny", "qwen3_tiny"])
def test_save_pretrained_weights_load_from_the_directory_or_a_file(tmp_path, preset):
    from safetensors.torch import save_file

    # two pretrained models, loaded in turn, so that every load shows by replacing the weights before it
    pretrained = {}
    for seed in (1, 2):
        torch.manual_seed(seed)
        pretrained[seed] = HFCausalLM(preset)
    a, b = (pretrained[seed].state_dict() for seed in (1, 2))
    # the transformers model's own names, without HFCausalLM's "model."; tied (qwen3): the head's name left out
    pretrained[1].model.save_pretrained(tmp_path / "a")
    pretrained[1].model.save_pretrained(tmp_path / "a_sharded", max_shard_size="40KB")
    pretrained[2].model.save_pretrained(tmp_path / "b")
    assert (tmp_path / "a_sharded" / "model.safetensors.index.json").exists()
    (tmp_path / "b_bin").mkdir()
    torch.save(pretrained[2].model.state_dict(), tmp_path / "b_bin" / "pytorch_model.bin")  # transformers < 5
    save_file({"encoder.weight": torch.zeros(3)}, tmp_path / "other.safetensors")
    loads = [
        (tmp_path / "a", {}, a),
        (tmp_path / "b" / "model.safetensors", {}, b),
        (tmp_path / "a_sharded", {}, a),
        (tmp_path / "b_bin", {}, b),
        (str(tmp_path / "a" / "model.safetensors"), {"prefix": "model."}, a),
        (tmp_path / "other.safetensors", {"strict": False}, None),
    ]
    fit(tmp_path, ZoffStrategy(start_method="fork"), Recorded(preset), max_steps=1, accumulate=1,
        callbacks=[LoadEach(loads, tmp_path)])
    for rank in (0, 1):
        *loaded, refused = json.loads((tmp_path / f"loads{rank}.json").read_text())
        assert loaded == [True] * 5
        assert refused.startswith("none of the 1 names in the weights is a name of the Recorded under any of its")
