"""zoff against torch's own optimizer under DDP: same per-step losses, sharded state, clear errors."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.multiprocessing import ProcessRaisedException

import helpers.trainer
import lightning_zoff
from helpers import tiny
from helpers.compare import rel_err
from helpers.tiny import SEQ, VOCAB, token_loader
from helpers.tiny_module import TinyModule, read_probe
from lightning_zoff import ZoffStatsMonitor, ZoffStrategy
from lightning_zoff.placement.plan import Placement, StateOptions, host_bytes_per_element


def fit(tmp_path, strategy, *, devices=2, precision="32-true", batch_size=4, max_steps=12, optimizer="adamw",
        accumulate=2, module=None, callbacks=(), **kw):
    pl.seed_everything(7)
    module = module or TinyModule(optimizer)
    trainer = helpers.trainer.fit(module, token_loader(batch_size=batch_size), strategy, out=tmp_path, devices=devices,
                                  precision=precision, max_steps=max_steps, accumulate=accumulate, clip=0.84,
                                  callbacks=callbacks, **kw)
    return trainer, module


@pytest.fixture(scope="module")
def ddp_losses(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    _, module = fit(out, DDPStrategy(start_method="fork"))
    return {**read_probe(out), "state_dict": module.state_dict()}


def test_zoff_matches_ddp_adamw_fp32(tmp_path, ddp_losses):
    _, module = fit(tmp_path, ZoffStrategy(start_method="fork", weights_to_main_process=True))
    zoff = read_probe(tmp_path)
    assert len(zoff["losses"]) == len(ddp_losses["losses"]) == 24  # 12 steps x 2 micro-batches
    assert rel_err(zoff["losses"], ddp_losses["losses"]) < 1e-5
    assert min(zoff["clip_coefs"]) < 1.0 == max(zoff["clip_coefs"])  # clipping active on some steps only
    assert zoff["lr"] == ddp_losses["lr"]  # StepLR moved the same groups the same way
    assert zoff["losses"][-1] < zoff["losses"][0] - 0.3  # it learns, so the comparison means something
    # the main process got the trained fp32 master weights back (gathered from the shards), equal to DDP's
    state = module.state_dict()
    assert state.keys() == ddp_losses["state_dict"].keys()
    for name, value in state.items():
        assert value.dtype == torch.float32
        assert type(value) is torch.Tensor
        torch.testing.assert_close(value, ddp_losses["state_dict"][name], rtol=1e-4, atol=1e-5)


def test_zoff_bf16_mixed_close_to_ddp(tmp_path, ddp_losses):
    fit(tmp_path, ZoffStrategy(start_method="fork"), precision="bf16-mixed")
    zoff = read_probe(tmp_path)
    assert zoff["param_dtypes"] == ["torch.bfloat16"]  # the accelerator holds only 16-bit shards
    assert zoff["state_dtypes"] == ["torch.float32"]
    assert zoff["state_devices"] == ["cpu"]
    assert rel_err(zoff["losses"], ddp_losses["losses"]) < 0.03


def test_bf16_moments_follow_fp32_training_with_less_host_memory(tmp_path, ddp_losses):
    # the same 32-true run as the DDP reference (torch.optim.AdamW, fp32 moments), the moments kept in bf16
    fit(tmp_path, ZoffStrategy(start_method="fork", optimizer_state_dtype="bf16"))
    zoff = read_probe(tmp_path)
    assert zoff["state_dtypes"] == ["torch.bfloat16", "torch.float32"]  # moments, master
    # 24 micro-batch losses within 1e-4 relative (measured: 4e-6; fp32 moments give 6e-8)
    assert rel_err(zoff["losses"], ddp_losses["losses"]) < 1e-4
    assert zoff["losses"][-1] < zoff["losses"][0] - 0.3
    mem = zoff["memory"]
    assert mem["host_optimizer_state"] == mem["host_master"]  # two 2-byte moments per 4-byte master element
    # overlap's spare sets: one unit's state (master and moments) for every two of the 4 units, not a copy of each
    assert 0 < mem["host_spare_state"] < mem["host_master"]
    # 32-true without the sets, accumulating 2 in fp32: 4 + 2 x 2 state, 4 window sum; the 4-byte gradients land in
    # a buffer of each unit's (the host has room: `staging_ring_units="auto"` takes no shared ring)
    expected = host_bytes_per_element(StateOptions(param_bytes=4, moment_bytes=2, moments=2, sum_bytes=4))
    assert expected == 12
    assert mem["host_staging"] == mem["host_master"]  # every unit's 4-byte landing, as many bytes as its master
    assert mem["host_total"] == expected * mem["host_master"] // 4 + mem["host_spare_state"] + mem["host_staging"]


def test_each_rank_holds_its_share_of_master_and_state(tmp_path):
    fit(tmp_path, ZoffStrategy(start_method="fork"), precision="bf16-true", max_steps=2, callbacks=[ZoffStatsMonitor()])
    ranks = [read_probe(tmp_path, r) for r in (0, 1)]
    total = ranks[0]["num_params"]
    for info in ranks:
        mem = info["memory"]
        assert info["torch_state_empty"]  # torch's optimizer holds no state: the engine does
        # fp32 master 4 B and moments 8 B per element of this rank's padded shard, about total / world
        assert mem["host_master"] * 2 == mem["host_optimizer_state"]
        assert total / 2 <= mem["host_master"] / 4 <= total / 2 * 1.02
        assert mem["accelerator_bytes_per_param"] == 2.0
        # the step breakdown reached the logger (ZoffStatsMonitor); 2 B/param each way: two 16-bit micro-batch shards
        # down (padded layout), one 16-bit parameter shard up
        tele = info["telemetry"]
        assert {"zoff/forward_s", "zoff/backward_s", "zoff/exposed_optimizer_s", "zoff/cpu_update_s",
                "zoff/placement_s"} <= tele.keys()
        assert tele["zoff/d2h_gb"] * 1e9 == pytest.approx(2 * 2 * mem["host_master"] / 4)
        assert tele["zoff/h2d_gb"] * 1e9 == pytest.approx(2 * mem["local_params"])
    assert sum(r["memory"]["local_params"] for r in ranks) == total


def test_one_process_matches_torch(tmp_path):
    out_ref = tmp_path / "ref"
    out_ref.mkdir()
    fit(out_ref, DDPStrategy(start_method="fork"), devices=1, batch_size=8)  # same sampler as zoff
    fit(tmp_path, ZoffStrategy(start_method="fork"), devices=1, batch_size=8)
    assert rel_err(read_probe(tmp_path)["losses"], read_probe(out_ref)["losses"]) < 1e-5


def test_adam_l2_matches_ddp(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    fit(ref, DDPStrategy(start_method="fork"), optimizer="adam", max_steps=6)
    fit(tmp_path, ZoffStrategy(start_method="fork"), optimizer="adam", max_steps=6)
    assert rel_err(read_probe(tmp_path)["losses"], read_probe(ref)["losses"]) < 1e-5


def test_registered_names():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="zoff", logger=False)
    assert isinstance(trainer.strategy, ZoffStrategy)
    assert trainer.strategy.config.offload
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="zoff_no_offload", logger=False)
    assert isinstance(trainer.strategy, ZoffStrategy)
    assert not trainer.strategy.config.offload
    assert lightning_zoff.ZoffStrategy is ZoffStrategy



@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 3])
def test_accumulation_windows_match_ddp(tmp_path, accumulate):
    # 1: the kernel reads the 16-bit staging buffer directly; 3: the fp32 host sum of three micro-batches
    ref = tmp_path / "ref"
    ref.mkdir()
    fit(ref, DDPStrategy(start_method="fork"), accumulate=accumulate, max_steps=8)
    fit(tmp_path, ZoffStrategy(start_method="fork"), accumulate=accumulate, max_steps=8)
    zoff, ddp = read_probe(tmp_path), read_probe(ref)
    assert len(zoff["losses"]) == 8 * accumulate
    assert rel_err(zoff["losses"], ddp["losses"]) < 1e-5
    # a window of one has no host sum: the kernel reads the staged gradient (32-true: 4 B/param)
    assert zoff["memory"]["host_grad_sum"] == (0 if accumulate == 1 else zoff["memory"]["host_master"])


def test_lion_matches_ddp_with_the_same_optimizer(tmp_path):
    # the reference runs lightning_zoff.optim.Lion as a plain optimizer on DDP's fp32 gradients
    ref = tmp_path / "ref"
    ref.mkdir()
    fit(ref, DDPStrategy(start_method="fork"), optimizer="lion", max_steps=8)
    fit(tmp_path, ZoffStrategy(start_method="fork"), optimizer="lion", max_steps=8)
    zoff, ddp = read_probe(tmp_path), read_probe(ref)
    assert rel_err(zoff["losses"], ddp["losses"]) < 1e-5
    assert zoff["losses"][-1] < zoff["losses"][0]


def test_no_offload_matches_ddp(tmp_path, ddp_losses):
    fit(tmp_path, ZoffStrategy(start_method="fork", offload=False))
    assert rel_err(read_probe(tmp_path)["losses"], ddp_losses["losses"]) < 1e-5


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_optimizer_state_on_the_accelerator_matches_ddp(tmp_path, ddp_losses, fraction):
    # "accelerator" placement in a CPU run takes the path a GPU's units take (torch ops, inline, no worker) on CPU
    # tensors, next to host units updated by the kernels on the worker (overlap, accumulation, clipping all on)
    fit(tmp_path, ZoffStrategy(start_method="fork", accelerator_state=fraction))
    zoff = read_probe(tmp_path)
    assert rel_err(zoff["losses"], ddp_losses["losses"]) < 1e-5
    assert set(zoff["placements"].values()) == ({"host", "accelerator"} if fraction < 1 else {"accelerator"})
    assert zoff["placements"]["model"] == "accelerator"  # the embedding's unit: the forward needs it first
    memory = zoff["memory"]
    assert memory["accelerator_optimizer_state"] > 0
    if fraction == 1.0:
        assert memory["host_total"] == 0


class GradientWhereItWaits(pl.Callback):
    """Before each optimizer step: whether every accelerator unit's gradient waits in its shards (none held apart)."""

    def __init__(self):
        self.in_shards = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        units = [u for u in trainer.strategy.engine.units if u.trained and u.placement is Placement.ACCELERATOR]
        self.in_shards.append(bool(units) and all(u.grad_in_shards and u.window_grad is None for u in units))

    def on_train_end(self, trainer, pl_module):
        assert self.in_shards
        assert all(self.in_shards), self.in_shards


def test_accelerator_units_keep_a_single_micro_batch_gradient_in_their_shards(tmp_path):
    # a window of one micro-batch: the accelerator's units take their gradient over their 16-bit shards, and the
    # update from there matches DDP's (clipping on, some steps clipped)
    ref = tmp_path / "ddp"
    ref.mkdir()
    _, ddp_module = fit(ref, DDPStrategy(start_method="fork"), accumulate=1)
    _, module = fit(tmp_path, ZoffStrategy(start_method="fork", accelerator_state=0.5, weights_to_main_process=True),
                    accumulate=1, callbacks=[GradientWhereItWaits()])
    zoff, ddp = read_probe(tmp_path), read_probe(ref)
    assert set(zoff["placements"].values()) == {"host", "accelerator"}
    assert rel_err(zoff["losses"], ddp["losses"]) < 1e-5
    assert min(zoff["clip_coefs"]) < 1.0
    expected = ddp_module.state_dict()
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5)


def test_a_forward_between_backward_and_step_is_refused(tmp_path):
    class ForwardBeforeStep(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            pl_module.model(torch.zeros(1, SEQ, dtype=torch.long))

    with pytest.raises(RuntimeError, match="ran a forward between the window's last backward and the"):
        fit(tmp_path, ZoffStrategy(start_method="fork", accelerator_state=1.0), accumulate=1, max_steps=2,
            callbacks=[ForwardBeforeStep()])


FAULT_STEP = 3


class OutOfMemoryInBackward(TinyModule):
    """At FAULT_STEP's first try the backward runs out of memory after the last blocks' gradients were reduced."""

    def __init__(self):
        super().__init__()
        self.faulted = False
        self.model.blocks[0].register_forward_hook(self._arm)

    def _arm(self, module, args, output):
        if self.trainer.global_step == FAULT_STEP and not self.faulted and torch.is_grad_enabled():
            self.faulted = True
            output.register_hook(self._raise)

    @staticmethod
    def _raise(grad):
        raise torch.OutOfMemoryError("injected: CUDA out of memory")


class MoveBackAtTheFaultStep(pl.Callback):
    """The run without the fault: the same unit moved back to the host before the same step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == FAULT_STEP and batch_idx == FAULT_STEP:
            assert trainer.strategy.engine.make_room() == ["model.blocks.2"]  # the last unit in forward order


def test_a_step_out_of_accelerator_memory_moves_state_back_and_runs_again(tmp_path):
    clean, faulted = tmp_path / "clean", tmp_path / "faulted"
    clean.mkdir()
    faulted.mkdir()
    # one rank: the case zoff recovers (with several, the ranks that did not fail wait in collectives)
    _, reference = fit(clean, ZoffStrategy(start_method="fork", accelerator_state=1.0, weights_to_main_process=True),
                       devices=1, accumulate=1, max_steps=6, callbacks=[MoveBackAtTheFaultStep()])
    pl.seed_everything(7)  # the clean run's initial weights (`fit` seeds before it builds its module)
    faulty = OutOfMemoryInBackward()
    _, module = fit(faulted, ZoffStrategy(start_method="fork", accelerator_state=1.0, weights_to_main_process=True),
                    devices=1, accumulate=1, max_steps=6, module=faulty)
    ran, expected = read_probe(faulted), read_probe(clean)
    assert len(ran["losses"]) == len(expected["losses"]) + 1  # the faulted try's loss, then the same batch's again
    assert ran["placements"] == expected["placements"] == {
        "model.blocks.0": "accelerator", "model.blocks.1": "accelerator", "model.blocks.2": "host",
        "model": "accelerator"}
    # the failed try changed nothing: every loss after it and the final weights have the clean run's bits
    assert ran["losses"][:FAULT_STEP] == expected["losses"][:FAULT_STEP]
    assert ran["losses"][FAULT_STEP + 1:] == expected["losses"][FAULT_STEP:]  # the faulted try logged its loss too
    for name, value in module.state_dict().items():
        assert torch.equal(value, reference.state_dict()[name]), name


class PlaceMoreAfterTheFirstStep(pl.Callback):
    """Does what accelerator_state="auto" does on a GPU after the first step, with room for the first unit only."""

    placed = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        if trainer.global_step == 1 and not self.placed:
            self.placed = True
            first = engine.forward_order[0]  # the unit the forward entered first
            assert engine.move([first], Placement.ACCELERATOR) == [first]


def test_state_moved_to_the_accelerator_between_steps_matches_ddp(tmp_path, ddp_losses):
    fit(tmp_path, ZoffStrategy(start_method="fork", accelerator_state="none"), callbacks=[PlaceMoreAfterTheFirstStep()])
    zoff = read_probe(tmp_path)
    assert rel_err(zoff["losses"], ddp_losses["losses"]) < 1e-5
    assert zoff["placements"] == {"model.blocks.0": "host", "model.blocks.1": "host", "model.blocks.2": "host",
                                  "model": "accelerator"}


@pytest.mark.slow
@pytest.mark.parametrize("retain", [False, True])
def test_accumulating_on_the_accelerator_gives_the_same_bits(tmp_path, retain):
    host, accel = tmp_path / "host", tmp_path / "accel"
    host.mkdir()
    accel.mkdir()
    _, host_module = fit(host, ZoffStrategy(start_method="fork", weights_to_main_process=True), precision="bf16-true",
                         accumulate=3, max_steps=5)
    _, accel_module = fit(accel, ZoffStrategy(start_method="fork", weights_to_main_process=True,
                                              grad_accum_on="accelerator",
                                              retain_gpu_grad_partition_until_step=retain),
                          precision="bf16-true", accumulate=3, max_steps=5)
    assert read_probe(accel)["losses"] == read_probe(host)["losses"]
    for a, b in zip(accel_module.state_dict().values(), host_module.state_dict().values(), strict=True):
        assert torch.equal(a, b)


class CountingGathers(pl.Callback):
    """Counts this rank's all-gathers over fit (FSDP2 gathers a unit's parameters with one) into gathers{rank}.txt."""

    # FSDP2's call: all_gather_single in torch 2.13, all_gather_into_tensor before
    NAME = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"

    def __init__(self, out):
        self.out = out

    def on_fit_start(self, trainer, pl_module):
        gather = getattr(torch.distributed, self.NAME)
        self.calls = 0

        def counted(*args, **kwargs):
            self.calls += 1
            return gather(*args, **kwargs)

        setattr(torch.distributed, self.NAME, counted)  # this rank's (a forked process's) torch only
        self.gather = gather

    def on_fit_end(self, trainer, pl_module):
        setattr(torch.distributed, self.NAME, self.gather)
        (self.out / f"gathers{trainer.global_rank}.txt").write_text(str(self.calls))


@pytest.mark.parametrize("state", ["none", 1.0])
def test_units_kept_gathered_until_backward_give_the_same_bits_with_half_the_gathers(tmp_path, state):
    """reshard_after_forward=False: each unit's parameters stay gathered from its forward to its backward, so backward
    gathers nothing; the same math, bit for bit, accumulating and clipped, with the state on the host and with it on
    the accelerator (whose units' shards hold the window's last gradient until the step)."""
    results = {}
    for keep in (False, True):
        out = tmp_path / f"keep_{keep}"
        strategy = ZoffStrategy(start_method="fork", weights_to_main_process=True, accelerator_state=state,
                                reshard_after_forward=not keep)
        _, module = fit(out, strategy, max_steps=4, callbacks=[CountingGathers(out)])
        results[keep] = (read_probe(out)["losses"], module.state_dict(), int((out / "gathers0.txt").read_text()))
    (losses, weights, gathers), (kept_losses, kept_weights, kept_gathers) = results[False], results[True]
    assert kept_losses == losses
    for a, b in zip(kept_weights.values(), weights.values(), strict=True):
        assert torch.equal(a, b)
    assert gathers > 0
    assert kept_gathers * 2 == gathers, (kept_gathers, gathers)


class TokensWithValidation(pl.LightningDataModule):
    def train_dataloader(self):
        return token_loader()

    def val_dataloader(self):
        return token_loader(n=16, seed=1)


@pytest.mark.slow
def test_units_kept_gathered_through_a_validation_forward_still_train_on_fresh_weights(tmp_path):
    """A no-grad forward (validation every 2 optimizer steps) has no backward to give the kept units' parameters up:
    the next steps must still train on the updated weights, as the default does, bit for bit."""
    results = {}
    for keep in (False, True):
        out = tmp_path / f"keep_{keep}"
        pl.seed_everything(7)
        module = TinyModule()
        strategy = ZoffStrategy(start_method="fork", weights_to_main_process=True, reshard_after_forward=not keep)
        helpers.trainer.fit(module, TokensWithValidation(), strategy, out=out, max_steps=6, accumulate=2, clip=0.84,
                            val_check_interval=4, num_sanity_val_steps=0, limit_val_batches=2)
        results[keep] = (read_probe(out)["losses"], module.state_dict())
    assert results[True][0] == results[False][0]
    for a, b in zip(results[True][1].values(), results[False][1].values(), strict=True):
        assert torch.equal(a, b)


class CountingBlock(tiny.Block):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # a recomputation in backward runs forward again
        return super().forward(x)


class CountingModule(TinyModule):
    def __init__(self, out):
        super().__init__()
        self.model.blocks = torch.nn.ModuleList(CountingBlock() for _ in range(3))
        self.out = out

    def on_train_end(self):
        calls = sum(b.calls for b in self.model.blocks)
        (self.out / f"calls{self.global_rank}.txt").write_text(str(calls))


def test_activation_checkpointing_changes_no_loss(tmp_path):
    results = {}
    for name, policy in (("plain", None), ("checkpointed", {CountingBlock}), ("first_two", 2)):
        out = tmp_path / name
        out.mkdir()
        pl.seed_everything(7)
        helpers.trainer.fit(CountingModule(out), token_loader(),
                            ZoffStrategy(start_method="fork", activation_checkpointing_policy=policy), out=out,
                            max_steps=4, accumulate=2, clip=0.84)
        results[name] = (read_probe(out)["losses"], int((out / "calls0.txt").read_text()))
    (plain_losses, plain_calls), (ac_losses, ac_calls) = results["plain"], results["checkpointed"]
    assert ac_losses == plain_losses  # bit for bit: the recomputed forward is the same computation
    assert plain_calls == 3 * 8
    assert ac_calls == 2 * plain_calls  # 8 micro-batches x 3 blocks, each run twice
    # a number of blocks: only the first two recompute, and nothing changes either
    two_losses, two_calls = results["first_two"]
    assert two_losses == plain_losses
    assert two_calls == plain_calls + 2 * 8


def test_more_blocks_to_recompute_than_the_model_has_is_refused(tmp_path):
    with pytest.raises((ValueError, ProcessRaisedException),
                       match=r"activation_checkpointing_policy=4: the model has 3 blocks"):
        fit(tmp_path, ZoffStrategy(start_method="fork", activation_checkpointing_policy=4), max_steps=1)


def test_activation_checkpointing_policy_must_match_a_module(tmp_path):
    # raised in the ranks at setup, before any step: the launcher hands it on wrapped
    with pytest.raises((ValueError, ProcessRaisedException),
                       match=r"activation_checkpointing_policy=.*GRU.*matches no"):
        fit(tmp_path, ZoffStrategy(start_method="fork", activation_checkpointing_policy={torch.nn.GRU}), max_steps=1)


class MetaCheck(TinyModule):
    def on_fit_start(self):
        # by now every parameter is real: each rank materialised and initialised its units while sharding
        assert not any(p.is_meta or p.to_local().is_meta for p in self.parameters())


class LateModule(TinyModule):
    """The model is built in configure_model (Lightning calls it in each rank, before the strategy's setup)."""

    def __init__(self):
        super().__init__()
        del self.model

    def configure_model(self):
        if not hasattr(self, "model"):
            self.model = tiny.TinyLM()


@pytest.mark.slow
def test_model_built_in_configure_model_trains_like_one_built_in_init(tmp_path):
    fit(tmp_path, ZoffStrategy(start_method="fork"), module=LateModule())
    zoff = read_probe(tmp_path)
    reference = tmp_path / "init"
    reference.mkdir()
    fit(reference, ZoffStrategy(start_method="fork"))
    assert zoff["losses"] == read_probe(reference)["losses"]  # bit for bit in 32-true: same init, same steps


def test_empty_init_builds_on_meta_and_each_rank_initialises_its_units(tmp_path):
    def build(trainer):
        with trainer.init_module(empty_init=True):
            module = MetaCheck()
        assert all(p.is_meta for p in module.parameters())  # nothing allocated in the parent
        return module

    pl.seed_everything(7)
    strategy = ZoffStrategy(start_method="fork", weights_to_main_process=True)
    trainer = helpers.trainer.fit(build, token_loader(), strategy, out=tmp_path, max_steps=12, accumulate=2)
    module = trainer.lightning_module
    losses = read_probe(tmp_path)["losses"]
    assert losses[-1] < losses[0] - 0.3  # initialised (reset_parameters) and learning
    # the main process got the trained fp32 weights, though its model never had memory of its own
    assert not any(p.is_meta for p in module.parameters())
    assert all(p.dtype == torch.float32 and p.abs().sum() > 0 for p in module.parameters())


class InitStats(pl.Callback):
    """At the start of fit, in rank 0: statistics of the gathered fp32 masters the ranks initialised."""

    def __init__(self, out):
        self.out = out

    def on_fit_start(self, trainer, pl_module):
        state = trainer.strategy.full_state_dict()
        if trainer.is_global_zero:
            stats = {name: [t.mean().item(), t.std().item()] for name, t in state.items() if t.numel() > 1}
            (self.out / "init.json").write_text(json.dumps(stats))


def fit_on_meta(out, build, **strategy_kw):
    def on_meta(trainer):
        with trainer.init_module(empty_init=True):
            return build()

    pl.seed_everything(7)
    helpers.trainer.fit(on_meta, token_loader(n=16), ZoffStrategy(start_method="fork", **strategy_kw), max_steps=1,
                        callbacks=[InitStats(out)])
    return json.loads((out / "init.json").read_text())


def test_meta_built_gpt_gets_its_own_init_in_the_ranks(tmp_path):
    from lightning_zoff.examples.gpt import GPTModule

    # the ranks run GPTModule.init_module_weights (N(0, 0.02)), not torch's defaults (kaiming-uniform: std 0.05 here)
    stats = fit_on_meta(tmp_path, lambda: GPTModule(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=128))
    for name in ("model.blocks.0.attn.qkv.weight", "model.blocks.1.mlp.proj.weight", "model.tok_emb.weight",
                 "model.lm_head.weight"):
        assert stats[name][1] == pytest.approx(0.02, rel=0.1), name
    assert stats["model.blocks.0.ln_1.weight"] == [1.0, 0.0]


def test_param_init_fn_initialises_what_was_built_on_meta(tmp_path):
    def constant(module):
        for p in module.parameters(recurse=False):
            torch.nn.init.constant_(p, 0.125)

    stats = fit_on_meta(tmp_path, TinyModule, param_init_fn=constant)
    assert stats
    assert all(value == [0.125, 0.0] for value in stats.values())
    with pytest.raises(TypeError, match=r"param_init_fn='normal'.*callable"):
        ZoffStrategy(param_init_fn="normal")
