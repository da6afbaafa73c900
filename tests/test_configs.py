"""Every Hydra config in conf/ composes, the cheap ones build, and bad input stops with a message naming the key and
the choices."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate
from lightning.fabric.utilities.imports import RequirementCache
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from omegaconf import OmegaConf
from torch.multiprocessing import ProcessRaisedException

import lightning_zoff.optim
from lightning_zoff import ZoffStrategy
from lightning_zoff.examples.corpus import CorpusDataModule, SyntheticDataModule
from lightning_zoff.examples.gpt import Block, GPTModule
from lightning_zoff.examples.hf import HFCausalLM
from lightning_zoff.placement.plan import StateOptions, host_bytes_per_element
from train_overrides import unknown_keys

CONF = Path(__file__).resolve().parents[1] / "conf"
# every option of every group (conf/cli/ is LightningCLI's, not Hydra's)
OPTIONS = sorted((p.parent.name, p.stem) for p in CONF.glob("*/*.yaml") if p.parent.name != "cli")


def compose_train(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize(("group", "name"), OPTIONS, ids=[f"{g}={n}" for g, n in OPTIONS])
def test_every_option_composes(group, name):
    cfg = compose_train(f"{group}={name}")
    OmegaConf.resolve(cfg)  # every interpolation (data.block_size -> model.block_size, ...) has a target
    assert cfg.keys() >= {"trainer", "strategy", "model", "data", "optimizer", "seed", "sample", "empty_init"}


def test_trainer_options():
    cpu, gpu = compose_train("trainer=cpu").trainer, compose_train("trainer=gpu").trainer
    assert (cpu.accelerator, cpu.devices, gpu.accelerator, gpu.precision) == ("cpu", 2, "gpu", "bf16-mixed")
    assert cpu.max_steps == gpu.max_steps == 200  # both from trainer/default.yaml
    trainer = pl.Trainer(**OmegaConf.to_container(cpu), strategy="zoff", logger=False)
    assert trainer.max_steps == 200
    assert trainer.num_devices == 2


@pytest.mark.parametrize(("name", "offload"), [("zoff", True), ("zoff_no_offload", False)])
def test_zoff_strategies_build_with_every_option(name, offload):
    cfg = compose_train(f"strategy={name}")
    strategy = instantiate(cfg.strategy)
    assert isinstance(strategy, ZoffStrategy)
    assert strategy.config.offload is offload
    # the yaml lists every keyword option of ZoffStrategy, so `--cfg job` shows them all
    keyword_options = set(ZoffStrategy.__init__.__kwdefaults__)
    assert set(cfg.strategy) - {"_target_"} == keyword_options
    config = strategy.config
    assert (config.start_method, config.pin_memory, config.grad_accum_on) == ("fork", True, "host")


def test_wrap_policy_takes_classes_from_the_command_line():
    block = "{_target_:hydra.utils.get_class,path:lightning_zoff.examples.gpt.Block}"
    cfg = compose_train(f"strategy.wrap_policy=[{block}]")
    assert instantiate(cfg.strategy).config.wrap_policy == {Block}


def test_ddp_and_deepspeed_strategies():
    assert isinstance(instantiate(compose_train("strategy=ddp").strategy), DDPStrategy)
    cfg = compose_train("strategy=deepspeed_zero3_offload", "optimizer=deepspeed_cpu_adam").strategy
    assert (cfg.stage, cfg.offload_optimizer, cfg.offload_optimizer_device, cfg.pin_memory) == (3, True, "cpu", True)
    if RequirementCache("deepspeed"):  # the GPU machine with the carried wheels: the config builds the strategy
        assert isinstance(instantiate(cfg), DeepSpeedStrategy)
        return
    with pytest.raises(InstantiationException, match=r"DeepSpeedStrategy.*must have DeepSpeed installed"):
        instantiate(cfg)


MODEL_SIZES = [("gpt_125m", 123e6, 126e6), ("gpt_1b", 1.33e9, 1.35e9), ("gpt_7b", 6.6e9, 6.8e9),
               ("gpt_13b", 12.9e9, 12.95e9), ("gpt_30b", 32.3e9, 32.35e9), ("hf_qwen3_4b", 4.02e9, 4.025e9),
               ("hf_llama3_8b", 8.03e9, 8.031e9), ("hf_qwen3_14b", 14.768e9, 14.769e9),
               ("hf_qwen25_7b", 7.615e9, 7.616e9)]


def test_every_model_option_is_tested():
    assert {name for group, name in OPTIONS if group == "model"} == {
        "gpt_tiny", "hf_llama_tiny", "hf_qwen3_tiny", "hf_llama_tiny_lora", *(name for name, _, _ in MODEL_SIZES)}


def test_the_lora_option_trains_rank_8_adapters_of_every_linear_layer_of_the_tiny_llama():
    pytest.importorskip("peft", reason="LoRA needs peft: pip install -e '.[lora]'")
    module = instantiate(compose_train("model=hf_llama_tiny_lora").model)
    trained = {name: p.shape for name, p in module.named_parameters() if p.requires_grad}
    # 2 blocks x 7 layers x (A, B); hidden 64, 2 KV heads of 16, intermediate 128
    assert len(trained) == 28
    assert trained["model.model.layers.1.mlp.down_proj.lora_A.default.weight"] == (8, 128)
    assert trained["model.model.layers.0.self_attn.k_proj.lora_B.default.weight"] == (32, 8)
    assert sum(p.numel() for p in module.parameters()) == 106_816 + 16_384  # the base and 2 x 8192 adapter elements


@pytest.mark.slow
def test_the_tiny_models_build_and_the_large_models_have_their_sizes():
    tiny = instantiate(compose_train().model)
    assert isinstance(tiny, GPTModule)
    assert 0.8e6 < tiny.model.num_params() < 1e6
    for name, preset, size in [("hf_llama_tiny", "llama_tiny", 106_816), ("hf_qwen3_tiny", "qwen3_tiny", 90_496)]:
        module = instantiate(compose_train(f"model={name}").model)
        assert isinstance(module, HFCausalLM), name
        assert module.hparams.model == preset, name
        assert sum(p.numel() for p in module.parameters()) == size, name
        assert module.block_size == 128, name
        assert type(module.hparams.config) is dict  # _convert_: plain values in checkpoints
    for name, low, high in MODEL_SIZES:
        with torch.device("meta"):  # shapes only: nothing is allocated
            model = instantiate(compose_train(f"model={name}").model)
        assert low < sum(p.numel() for p in model.parameters()) < high, name
    big = compose_train("model=gpt_1b").model
    assert (big.n_embd, big.n_layer, big.n_head, big.block_size, big.vocab_size) == (2048, 24, 16, 1024, 32000)
    with torch.device("meta"):
        qwen3_4b = instantiate(compose_train("model=hf_qwen3_4b").model)
    config = qwen3_4b.model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == (
            2560, 36, 32, 8, 9728, 151936, True)
    assert qwen3_4b.model.lm_head.weight is qwen3_4b.model.model.embed_tokens.weight
    for name, shape in [("hf_llama3_8b", (4096, 32, 32, 8, 14336, 128256, False, 500_000.0, 4096)),
                        ("hf_qwen3_14b", (5120, 40, 40, 8, 17408, 151936, False, 1_000_000.0, 4096)),
                        ("hf_qwen25_7b", (3584, 28, 28, 4, 18944, 152064, False, 1_000_000.0, 1024))]:
        with torch.device("meta"):
            module = instantiate(compose_train(f"model={name}").model)
        config = module.model.config
        assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                config.intermediate_size, config.vocab_size, config.tie_word_embeddings,
                config.rope_parameters["rope_theta"], module.block_size) == shape, name


def test_the_largest_models_are_built_on_the_meta_device(train_script):
    on_meta = {name for group, name in OPTIONS if group == "model" and compose_train(f"model={name}").empty_init}
    assert on_meta == {"gpt_7b", "gpt_13b", "gpt_30b", "hf_qwen3_4b", "hf_llama3_8b", "hf_qwen3_14b", "hf_qwen25_7b"}
    assert not compose_train("model=gpt_7b", "empty_init=false").empty_init  # the command line still wins
    train_script.check_empty_init(ZoffStrategy(), True)
    train_script.check_empty_init(DDPStrategy(), False)
    with pytest.raises(ValueError, match=r"empty_init=true needs strategy=zoff or zoff_no_offload: DDPStrategy would"
                                         " train uninitialised weights. Add empty_init=false."):
        train_script.check_empty_init(DDPStrategy(), True)


def test_data_follows_the_model():
    corpus = instantiate(compose_train("model=gpt_1b").data)
    assert isinstance(corpus, CorpusDataModule)
    assert corpus.block_size == 1024
    synthetic = instantiate(compose_train("data=synthetic", "model=gpt_125m").data)
    assert isinstance(synthetic, SyntheticDataModule)
    assert (synthetic.vocab_size, synthetic.block_size) == (50304, 1024)
    assert instantiate(compose_train("model=hf_qwen3_tiny").data).block_size == 128
    synthetic = instantiate(compose_train("data=synthetic", "model=hf_qwen3_4b").data)
    assert (synthetic.vocab_size, synthetic.block_size) == (151936, 512)


def test_the_qwen25_7b_option_trains_at_megatrains_configuration():
    # MegaTrain's Qwen2.5-7B run (seq 1024, 4 loader workers, recompute) as the bench's megatrain_qwen25_7b preset
    cfg = compose_train("model=hf_qwen25_7b")
    data = instantiate(cfg.data)
    assert (data.num_workers, data.batch_size, data.block_size, cfg.trainer.accumulate_grad_batches) == (4, 8, 1024, 18)
    policy = instantiate(cfg.strategy).config.activation_checkpointing_policy
    assert {c.__name__ for c in policy} == {"Qwen2DecoderLayer"}
    assert compose_train("model=hf_qwen25_7b", "trainer.accumulate_grad_batches=1").trainer.accumulate_grad_batches == 1


@pytest.mark.parametrize("data", ["corpus", "synthetic"])
def test_the_real_shapes_load_with_four_workers_a_sequence_a_batch(data):
    # users' runs: 4 loader workers, batch 1 of 4096 tokens (the command line still wins)
    for name in ("hf_llama3_8b", "hf_qwen3_14b"):
        loaded = instantiate(compose_train(f"data={data}", f"model={name}").data)
        assert (loaded.num_workers, loaded.batch_size, loaded.block_size) == (4, 1, 4096), name
    assert instantiate(compose_train("model=hf_llama3_8b", "data.num_workers=0").data).num_workers == 0


@pytest.mark.parametrize("model", ["gpt_tiny", "hf_qwen3_tiny"])
@pytest.mark.parametrize(("name", "kind"), [("adamw", torch.optim.AdamW), ("lion", lightning_zoff.optim.Lion),
                                       ("sgd", torch.optim.SGD)])
def test_optimizers_are_factories_of_the_model(name, kind, model):
    cfg = compose_train(f"optimizer={name}", "optimizer.lr=0.02", f"model={model}")
    model = instantiate(cfg.model, optimizer=instantiate(cfg.optimizer))
    optimizer = model.configure_optimizers()
    assert type(optimizer) is kind
    decay, no_decay = optimizer.param_groups
    assert decay["lr"] == no_decay["lr"] == 0.02
    assert decay["weight_decay"] == cfg.optimizer.weight_decay
    assert no_decay["weight_decay"] == 0.0
    assert all(type(b) is float for b in decay.get("betas", ()))  # plain values, not OmegaConf nodes


def test_bench_experiment():
    cfg = compose_train("experiment=bench")
    assert cfg.model.n_embd == 2048
    assert cfg.data._target_.endswith("SyntheticDataModule")
    assert (cfg.trainer.accelerator, cfg.trainer.precision, cfg.data.batch_size) == ("gpu", "bf16-mixed", 8)
    assert (cfg.optimizer.lr, cfg.trainer.gradient_clip_val, cfg.save_checkpoint) == (1e-4, 1.0, False)


# -- bad input -----------------------------------------------------------------------------------------------------


def test_unknown_key_is_named():
    with pytest.raises(ConfigCompositionException, match=r"Could not override 'trainer\.max_step'") as err:
        compose_train("trainer.max_step=3")
    assert "Key 'max_step' is not in struct" in str(err.value.__cause__)


@pytest.fixture(scope="module")
def train_script():
    spec = importlib.util.spec_from_file_location("train_script", CONF.parent / "scripts" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_main_job_lists_the_keys_that_exist():
    # scripts/train.py stops with these before Hydra runs (Hydra would name only the bad key)
    unknown = unknown_keys(["strategy=ddp", "trainer.max_step=3", "strategy.offload=false", "optimizer.lr=1"])
    assert len(unknown) == 2
    assert re.fullmatch(r"'trainer\.max_step' does not exist; trainer has: accelerator, .*, max_steps, .*", unknown[0])
    assert unknown[1] == "'strategy.offload' does not exist; strategy has: _target_, start_method"  # ddp's keys


@pytest.mark.parametrize(("argv", "message"), [
    # nothing reads a key added at the top level or under sample: refused, with the keys there
    (["+ckpt_pth=last"], r"'ckpt_pth' does not exist; the configuration has: callbacks, .*, ckpt_path, .*trainer"),
    (["max_steps=3"], r"'max_steps' does not exist; the configuration has: .*"),
    (["+sample.prompt_text=x"], r"'sample\.prompt_text' does not exist; sample has: max_new_tokens, prompt, .*"),
    (["+trainer.max_stepz=3"], r"'trainer\.max_stepz' does not exist; trainer has: accelerator, .*"),
    (["+optimizer.momentum=0.9"], r"'optimizer\.momentum' does not exist; optimizer has: .*lr, weight_decay"),
    (["trainer.profiler=simple"], r"'trainer\.profiler' does not exist; .* not listed: \+trainer\.profiler=\.\.\.\)"),
    (["+ckpt_path=last"], r"'\+ckpt_path' adds a key that exists; set it with ckpt_path=\.\.\."),
    (["model=hf_llama_tiny", "model.config.num_hidden_layers=4"],
     r"'model\.config\.num_hidden_layers' does not exist; model\.config is empty: add the key with \+.*"),
    (["trainer.nothing.here=1"], r"'trainer\.nothing\.here' does not exist; trainer has: accelerator, .*"),
])
def test_the_main_job_refuses_a_key_nothing_reads(argv, message):
    [refused] = unknown_keys(argv)
    assert re.fullmatch(message, refused), refused


@pytest.mark.parametrize("argv", [
    ["+trainer.profiler=simple"],  # an argument of the Trainer that conf/ does not list
    ["+optimizer.amsgrad=false"],  # of the optimizer's _target_
    ["model=hf_llama_tiny", "+model.config.num_hidden_layers=4"],  # a free mapping: values over the preset's
    ["-m", "optimizer=adamw,lion", "optimizer.lr=1e-3"],  # a swept group: its keys are Hydra's to check
    ["hydra.run.dir=/tmp/run", "seed=3", "ckpt_path=last", "strategy=ddp", "strategy.start_method=spawn"],
])
def test_the_main_job_accepts_what_something_reads(argv):
    assert unknown_keys(argv) == []


def test_unknown_option_lists_the_options():
    with pytest.raises(ConfigCompositionException, match=r"(?s)Could not find 'strategy/zof'.*Available options in "
                                                         r"'strategy':.*ddp.*deepspeed_zero3_offload.*zoff"):
        compose_train("strategy=zof")


@pytest.mark.parametrize(("override", "message"), [
    ("strategy.offload=maybe", r"ZoffStrategy\(offload='maybe'\): expected true or false"),
    ("strategy.pin_memory=1", r"ZoffStrategy\(pin_memory=1\): expected true or false"),
    ("strategy.cpu_threads=two", r"ZoffStrategy\(cpu_threads='two'\): expected a positive integer, or None"),
    ("strategy.grad_accum_on=gpu", r"grad_accum_on='gpu'; choose 'host' or 'accelerator'"),
    ("strategy.optimizer_state_dtype=fp16", r"optimizer_state_dtype='fp16'; choose 'fp32' or 'bf16'"),
    ("strategy.start_method=thread", r"start_method='thread'; choose 'subprocess', 'fork', 'spawn' or 'forkserver'"),
])
def test_strategy_option_of_the_wrong_kind(override, message):
    with pytest.raises(InstantiationException, match=message):
        instantiate(compose_train(override).strategy)


def test_option_types_in_python():
    for bad in (0, True, 1.5, "2"):
        with pytest.raises(TypeError, match="cpu_threads"):
            ZoffStrategy(cpu_threads=bad)
    with pytest.raises(TypeError, match=r"retain_gpu_grad_partition_until_step=None"):
        ZoffStrategy(retain_gpu_grad_partition_until_step=None)
    assert ZoffStrategy(cpu_threads=3, offload=False).config.cpu_threads == 3


class NoTraining(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        raise AssertionError("training must not start")


def test_the_main_job_names_the_optimizer_choice(train_script):
    sgd = instantiate(compose_train("optimizer=sgd").optimizer)
    with pytest.raises(ValueError, match=r"optimizer=sgd: strategy='zoff' .* supports torch\.optim\.AdamW, .*Lion;"):
        train_script.check_optimizer(ZoffStrategy(), sgd, "sgd")
    train_script.check_optimizer(DDPStrategy(), sgd, "sgd")  # other strategies run any optimizer
    for name in ("adamw", "lion"):
        train_script.check_optimizer(ZoffStrategy(), instantiate(compose_train(f"optimizer={name}").optimizer), name)


def test_zoff_refuses_sgd_before_training():
    cfg = compose_train("optimizer=sgd", "model.n_layer=1", "data.max_bytes=100000")
    trainer = pl.Trainer(**OmegaConf.to_container(cfg.trainer), strategy=instantiate(cfg.strategy), logger=False,
                         callbacks=[NoTraining()], enable_progress_bar=False, enable_model_summary=False)
    model = instantiate(cfg.model, optimizer=instantiate(cfg.optimizer))
    with pytest.raises((TypeError, ProcessRaisedException),
                       match=r"supports torch\.optim\.AdamW, .*lightning_zoff\.optim\.Lion; configure_optimizers "
                             r"returned torch\.optim\.sgd\.SGD"):
        trainer.fit(model, datamodule=instantiate(cfg.data))


@pytest.mark.parametrize(("override", "message"), [
    ("data.batch_size=0", "data.batch_size=0: expected a positive integer"),
    ("data.num_workers=-1", "data.num_workers=-1: expected 0"),
    ("data.val_fraction=0.5", "data.val_fraction=0.5: expected a fraction above 0 and below 0.5"),
    ("data.max_bytes=300", "data.max_bytes=300: 300 bytes of source leave no training window of block_size=128"),
    ("model.block_size=0", "data.block_size=0: expected a positive integer"),  # data.block_size follows the model's
])
def test_the_main_job_names_a_data_value_that_leaves_no_data(train_script, override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        train_script.build_data(compose_train(override))


def test_synthetic_data_values_are_checked(train_script):
    with pytest.raises(ValueError, match=re.escape("data.num_samples=0: expected a positive integer")):
        train_script.build_data(compose_train("data=synthetic", "data.num_samples=0"))
    assert len(train_script.build_data(compose_train("data=synthetic", "data.num_samples=1")).train_set) == 1


def test_the_bytes_per_parameter_conf_cites_are_the_plans():
    # README's "What fits": 14 B/param of host memory with fp32 moments, 10 with bf16 (16-bit model, Adam)
    cited = {int(n) for path in CONF.rglob("*.yaml") for n in re.findall(r"(\d+) B/param", path.read_text())}
    planned = {host_bytes_per_element(StateOptions(param_bytes=2, moment_bytes=m, moments=2, sum_bytes=0))
               for m in (4, 2)}
    assert cited
    assert cited <= planned == {14, 10}


def test_the_guides_hydra_trainer_config_builds_a_zoff_trainer():
    # docs/guide.md, "The Trainer of your own Hydra app": the block as written, on this machine's CPU
    guide = (CONF.parent / "docs" / "guide.md").read_text()
    section = guide.split("### The Trainer of your own Hydra app", 1)[1].split("\n### ", 1)[0]
    block = re.search(r"^```yaml\n(.*?)^```$", section, re.DOTALL | re.MULTILINE).group(1)
    config = OmegaConf.merge(OmegaConf.create(block), {"accelerator": "cpu", "precision": "bf16-mixed"})
    trainer = instantiate(config, logger=False)
    assert isinstance(trainer, pl.Trainer)
    assert isinstance(trainer.strategy, ZoffStrategy)
    assert trainer.strategy.num_processes == 2
    assert trainer.strategy.config.start_method == "fork"
