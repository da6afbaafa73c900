"""The runs scripts/bench/bench.py measures: how each one is built (`RUN_SPECS`, a table of `RunSpec` by name) and
measured (`run_one`, in a process of its own through harness.run_function). The same model and AdamW hyperparameters
everywhere."""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import psutil
from typing_extensions import override

from zoffbench import torchao_run
from zoffbench.deepspeed_runs import DEEPSPEED_RUNS, ZERO_STAGE, build_strategy, optimizer_factory, unsupported
from zoffbench.fabric_run import run_fabric
from zoffbench.fsdp_runs import (
    FSDP2_RUN,
    FSDP_RUN,
    ClippedByFSDP,
    ShardedByFSDP2WithCPUOffload,
    fsdp1_strategy,
    host_params_strategy,
)
from zoffbench.harness import BenchRun, StepMeasurement, after_placement_pause, clipped_fraction, parse_options
from zoffbench.host_floor import host_floor
from zoffbench.model_shapes import model_shape
from zoffbench.recompute import block_class, recompute_blocks, recompute_forwards

if TYPE_CHECKING:  # for the checker only
    from lightning.fabric.connector import _PRECISION_INPUT
    from lightning.pytorch import LightningModule as _MixedInto
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from torch import nn
else:
    _MixedInto = object  # a LightningModule to the checker; at run time with_mixin puts the mixin before the family

# zoff variants: where the optimizer state lives, the synchronous engine, where the sum of an accumulation window
# lives, the kernels' threads, bf16 moments
ZOFF_VARIANTS: dict[str, dict[str, Any]] = {
    "zoff": {},  # accelerator_state="auto": as much optimizer state on the GPU as fits after the first step
    "zoff_host_only": dict(accelerator_state="none"),  # all optimizer state on the host
    "zoff_sync": dict(overlap=False, accelerator_state="none"),
    "zoff_half_on_gpu": dict(accelerator_state=0.5),
    "zoff_16_threads": dict(cpu_threads=16),  # every core to the kernels, none kept for the training thread
    "zoff_accum_host": dict(grad_accum_on="host"),
    "zoff_accum_gpu": dict(grad_accum_on="accelerator"),
    "zoff_accum_gpu_retained": dict(grad_accum_on="accelerator", retain_gpu_grad_partition_until_step=True),
    "zoff_bf16_moments": dict(optimizer_state_dtype="bf16"),  # 20 B/param of host traffic instead of 28
    "zoff_no_update_share": dict(accelerator_update_share="none"),  # the host's cores run every host unit's update
    "zoff_bf16_moments_no_update_share": dict(optimizer_state_dtype="bf16", accelerator_update_share="none"),
    # the 7B-on-128-GB configuration, all on the host
    "zoff_sync_bf16_moments": dict(overlap=False, optimizer_state_dtype="bf16", accelerator_state="none"),
}
# "zoff" trained in a plain Fabric loop (fabric_run.py) instead of the Trainer
FABRIC_RUN = "zoff_fabric"
DEFAULT_RUNS = ("gpu_only", "zoff", *DEEPSPEED_RUNS, FSDP2_RUN)
ADAMW: dict[str, Any] = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def is_zoff(name: str) -> bool:
    return name in ZOFF_VARIANTS or name in ("zoff_no_offload", FABRIC_RUN)


def inexact_because(name: str, zoff_options: dict, clip: float | None = None) -> str | None:
    """Why run `name` does not compute AdamW's update of every parameter at every step in fp32 state, or None; `clip`:
    the norm the call clips the other runs at (torchao's run is not clipped)."""
    if name == "deepspeed_zero2_zenflow":
        return "ZenFlow updates the top gradient columns each step, the rest every update_interval steps"
    if name == torchao_run.NAME and clip is not None:
        return f"{torchao_run.UNCLIPPED}; the other runs clip at {clip}"
    options = {**ZOFF_VARIANTS.get(name, {}), **zoff_options} if is_zoff(name) else {}
    if options.get("optimizer_state_dtype") == "bf16":
        return "moments stored in bf16"
    return None


def model_spec(model_name: str, layers: int | None = None, seq: int | None = None) -> dict:
    """The model's shape, with `layers` blocks instead of its own if given (GPTs only) and `seq` as its sequence
    length (`block_size`: a GPT's position table, a Hugging Face preset's batches)."""
    spec = model_shape(model_name)
    if layers is not None:
        if "hf" in spec:
            raise SystemExit(f"--layers: {model_name} is a Hugging Face preset; choose a GPT shape")
        spec["n_layer"] = layers
    if seq is not None:
        spec["block_size"] = seq
    return spec


def bench_run(name: str, model_name: str, accumulate: int, batch: int, zoff_option: list[str],
              gpu_memory_gb: float | None, layers: int | None, checkpointing: bool,
              ratio: float | None = None, clip: float | None = 1.0, seq: int | None = None,
              num_workers: int = 0, data: str = "random") -> BenchRun:
    exact = inexact_because(name, parse_options(zoff_option), clip) is None
    spec = model_spec(model_name, layers, seq)
    return BenchRun(name=name, model=model_name, layers=spec.get("n_layer"), activation_checkpointing=checkpointing,
                    accumulate=accumulate, batch=batch, seq=spec["block_size"], num_workers=num_workers,
                    gpu_memory_gb=gpu_memory_gb, exact=exact, gradient_clip_val=run_clip(name, clip), ratio=ratio,
                    data=data)


def run_clip(name: str, clip: float | None) -> float | None:
    """The norm run `name` clips at: the call's, but none for torchao's run."""
    return None if name == torchao_run.NAME else clip


def unsupported_here(name: str, accumulate: int, clip_asked: bool, gpus: int) -> str | None:
    """Why run `name` cannot run in this call on this machine (`gpus` visible), or None; `clip_asked`: --clip NORM
    was given on the command line."""
    if name == FSDP_RUN and gpus == 0:
        return "Lightning's FSDPStrategy needs a GPU accelerator"
    if name == torchao_run.NAME:
        return torchao_run.refusal(clip_asked, gpus)
    return unsupported(name, accumulate)


def family_of(model_name: str, layers: int | None = None, seq: int | None = None) -> tuple[type, dict[str, Any]]:
    """The LightningModule class of the model and its keyword arguments."""
    spec = model_spec(model_name, layers, seq)
    if "hf" in spec:
        from lightning_zoff.examples.hf import HFCausalLM

        return HFCausalLM, dict(model=spec["hf"])
    from lightning_zoff.examples.gpt import GPTModule

    return GPTModule, spec


def model_block(model_name: str, layers: int | None = None, seq: int | None = None) -> type:
    """The class of the model's blocks: what --activation-checkpointing recomputes, Lightning FSDP's unit."""
    family, kwargs = family_of(model_name, layers, seq)
    return block_class(family, tuple(sorted(kwargs.items())))


def zoff_run_options(name: str, zoff_options: dict, model_name: str, layers: int | None,
                     checkpointing: bool) -> dict[str, Any]:
    """The zoff options of run `name`: its variant's, then --zoff-option's, and with `checkpointing` the blocks' (unless
    --zoff-option names the policy itself: a preset may recompute every peer's blocks and leave zoff's to "auto")."""
    options = {**ZOFF_VARIANTS.get(name, {}), **zoff_options, "offload": name != "zoff_no_offload"}
    if checkpointing and "activation_checkpointing_policy" not in zoff_options:
        options["activation_checkpointing_policy"] = {model_block(model_name, layers)}
    return options


def fabric_parts(model_name: str, zoff_options: dict, layers: int | None, checkpointing: bool,
                 seq: int | None = None) -> tuple[type, dict[str, Any], dict[str, Any]]:
    """The Fabric run's module class and arguments (GPT shapes: its loop calls `model(x, y)` for the loss) and zoff
    options."""
    if "hf" in model_spec(model_name, layers):
        raise SystemExit(f"--runs {FABRIC_RUN}: GPT shapes only")
    family, kwargs = family_of(model_name, layers, seq)
    return family, kwargs, zoff_run_options(FABRIC_RUN, zoff_options, model_name, layers, checkpointing)


@dataclass(frozen=True)
class RunSetting:
    """What one run of bench.py is asked for: its name, the model and the options its build reads."""

    name: str
    model_name: str
    zoff_options: dict[str, Any]
    accumulate: int = 1
    ratio: float | None = None  # deepspeed_zero3_offload_ratio's offload_optimizer.ratio
    layers: int | None = None
    checkpointing: bool = False
    seq: int | None = None  # None: the model's own sequence length

    def family(self) -> tuple[type, dict[str, Any]]:
        return family_of(self.model_name, self.layers, self.seq)

    def recomputed(self) -> type | None:
        """The block class recomputed in backward (--activation-checkpointing), or None."""
        return model_block(self.model_name, self.layers, self.seq) if self.checkpointing else None


@dataclass(frozen=True)
class RunSpec:
    """How a kind of run is built: the Trainer's strategy, its precision, and the module (given the Trainer, whose
    `init_module` a run may build under)."""

    strategy: Callable[[RunSetting], Any]
    module: Callable[[RunSetting, Any], Any]
    precision: _PRECISION_INPUT = "bf16-mixed"


class BuiltUnderZeroInit(_MixedInto):
    """Mixed into a run's LightningModule class: the model built again in `configure_model`, under DeepSpeed's
    zero.Init, so that each parameter is partitioned as it is created."""

    model: nn.Module  # the family's model
    recomputed: type | None = None  # the block class to recompute, set by deepspeed_module

    @override
    def configure_model(self) -> None:
        if any(p.is_meta for p in self.model.parameters()):
            self.model = type(self.model)(self.model.config)
            recompute_forwards(self, self.recomputed)  # no checkpoint wrapper: zero.Init is active


def with_mixin(mixin: type, family: type) -> type:
    """`family` with `mixin`'s methods first."""
    return type(f"{mixin.__name__}{family.__name__}", (mixin, family), {})


def plain_module(run: RunSetting, trainer: Any) -> Any:
    # gpu_only uses torch's default (foreach) AdamW on the GPU: Lightning refuses clipping with the fused one
    family, kwargs = run.family()
    module = family(**kwargs, **ADAMW)
    recompute_blocks(module, run.recomputed())
    return module


def deepspeed_strategy(run: RunSetting) -> Any:
    return build_strategy(run.name, ADAMW, run.accumulate, run.ratio)


def deepspeed_module(run: RunSetting, trainer: Any) -> Any:
    import torch

    family, kwargs = run.family()
    optimizer = optimizer_factory(run.name, ADAMW)
    if ZERO_STAGE[run.name] == 2:  # ZeRO-2 keeps the whole 16-bit model on every GPU: built as usual
        module = family(**kwargs, optimizer=optimizer)
        recompute_blocks(module, run.recomputed())
        return module
    with torch.device("meta"):  # shapes only: configure_model builds the model for real
        module = with_mixin(BuiltUnderZeroInit, family)(**kwargs, optimizer=optimizer)
    module.recomputed = run.recomputed()
    return module


def host_module(run: RunSetting, mixin: type) -> Any:
    """The FSDP runs' module: built on the CPU, where CPU offload keeps the parameters, with `mixin`'s methods and
    torch's fused AdamW (which steps the host's parameters on the CPU)."""
    import torch

    family, kwargs = run.family()
    optimizer = functools.partial(torch.optim.AdamW, **ADAMW, fused=True)
    with torch.device("cpu"):
        return with_mixin(mixin, family)(**kwargs, optimizer=optimizer)


def fsdp2_module(run: RunSetting, trainer: Any) -> Any:
    module = host_module(run, ShardedByFSDP2WithCPUOffload)
    recompute_blocks(module, run.recomputed())  # before sharding: each wrapped block becomes the unit
    return module


def zoff_strategy(run: RunSetting) -> Any:
    from lightning_zoff import ZoffStrategy

    return ZoffStrategy(**zoff_run_options(run.name, run.zoff_options, run.model_name, run.layers, run.checkpointing))


def zoff_module(run: RunSetting, trainer: Any) -> Any:
    family, kwargs = run.family()
    with trainer.init_module(empty_init=True):  # each rank initialises only its own units
        return family(**kwargs, **ADAMW)


# Every run bench.py builds with the Trainer (FABRIC_RUN and torchao's run have their own loops: fabric_run.py,
# torchao_run.py). The same model and AdamW hyperparameters (lr 1e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on
# matrices) everywhere. DeepSpeed's ZeRO-3 runs build the model under zero.Init, its ZeRO-2 runs as usual; the FSDP
# runs build it on the CPU, where their CPU offload keeps it (fsdp_runs.py); FSDP2 casts to bf16 itself
# (MixedPrecisionPolicy), so "32-true" keeps Lightning's plugin out of its way; zoff builds on the meta device, each
# rank its own units.
RUN_SPECS: dict[str, RunSpec] = {
    "gpu_only": RunSpec(strategy=lambda run: "auto", module=plain_module),
    **{name: RunSpec(strategy=deepspeed_strategy, module=deepspeed_module) for name in DEEPSPEED_RUNS},
    FSDP2_RUN: RunSpec(strategy=lambda run: host_params_strategy(), module=fsdp2_module, precision="32-true"),
    FSDP_RUN: RunSpec(strategy=lambda run: fsdp1_strategy(model_block(run.model_name, run.layers, run.seq),
                                                          run.checkpointing),
                      module=lambda run, trainer: host_module(run, ClippedByFSDP)),
    **{name: RunSpec(strategy=zoff_strategy, module=zoff_module) for name in (*ZOFF_VARIANTS, "zoff_no_offload")},
}


def build_run(name: str, model_name: str, zoff_options: dict, accumulate: int = 1, ratio: float | None = None,
              layers: int | None = None, checkpointing: bool = False,
              seq: int | None = None) -> tuple[Callable[[Any], Any], Any, _PRECISION_INPUT]:
    """(module factory taking the Trainer, strategy, precision) of run `name` (`RUN_SPECS`). With `checkpointing`,
    every run recomputes each block's activations in backward: zoff and Lightning's FSDP by their own option, the
    others by torch's checkpoint wrapper (recompute.py)."""
    run = RunSetting(name, model_name, zoff_options, accumulate, ratio, layers, checkpointing, seq)
    spec = RUN_SPECS[name]
    return functools.partial(spec.module, run), spec.strategy(run), spec.precision


RUNS = (*RUN_SPECS, FABRIC_RUN, torchao_run.NAME)


def cap_gpu_memory(gpu_memory_gb: float | None) -> None:
    """Cap torch's allocator on this rank's GPU at `gpu_memory_gb` GiB, as on a GPU that small."""
    import torch

    if gpu_memory_gb is None:
        return
    if not torch.cuda.is_available():
        print(f"--gpu-memory-gb {gpu_memory_gb}: no GPU here, nothing to cap", file=sys.stderr)
        return
    device = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning's ranks re-run this command line with it set
    total = torch.cuda.get_device_properties(device).total_memory
    if gpu_memory_gb * 2**30 > total:
        raise SystemExit(f"--gpu-memory-gb {gpu_memory_gb}: GPU {device} has only {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(gpu_memory_gb * 2**30 / total, device)


def run_one(name: str, model_name: str, accumulate: int, steps: int, warmup: int, batch: int, devices: int,
            zoff_option: list[str], ratio: float | None = None, gpu_memory_gb: float | None = None,
            layers: int | None = None, checkpointing: bool = False, clip: float | None = 1.0, seq: int | None = None,
            num_workers: int = 0, data: str = "random") -> dict | None:
    """Train run `name` for `warmup` + `steps` optimizer steps on `data` (random tokens or the main job's text, through
    `num_workers` loader processes) and measure it: this rank's entry of bench.py's JSON, returned (the plain loops of
    torchao and Fabric) or reported by the run itself when its training ended (the Trainer's runs: None)."""
    import lightning.pytorch as pl
    import torch

    import lightning_zoff  # noqa: F401
    from zoffbench.data import RandomTokens, TextTokens
    from zoffbench.harness import report
    from zoffbench.recorders import AtTrainEnd, WindowTimer

    cap_gpu_memory(gpu_memory_gb)
    zoff_options = parse_options(zoff_option)
    cfg = model_spec(model_name, layers, seq)
    if "hf" in cfg:
        from lightning_zoff.examples.hf import hf_config

        cfg = {**cfg, "vocab_size": hf_config(cfg["hf"]).vocab_size}
    pl.seed_everything(0)
    data_module = (TextTokens(seq=cfg["block_size"], batch=batch, num_workers=num_workers) if data == "text" else
                   RandomTokens(vocab_size=cfg["vocab_size"], seq=cfg["block_size"], batch=batch,
                                length=devices * (batch * accumulate * (steps + warmup) + batch),
                                num_workers=num_workers))
    run = bench_run(name, model_name, accumulate, batch, zoff_option, gpu_memory_gb, layers, checkpointing, ratio,
                    clip, seq, num_workers, data)
    if name == torchao_run.NAME:
        setting = RunSetting(name, model_name, zoff_options, layers=layers, checkpointing=checkpointing, seq=seq)
        return torchao_run.run_torchao(run, *setting.family(), ADAMW, data_module, recompute=setting.recomputed(),
                                       accumulate=accumulate, steps=steps, warmup=warmup, batch=batch,
                                       block_size=cfg["block_size"],
                                       inexact_because=inexact_because(name, zoff_options, clip))
    if name == FABRIC_RUN:
        family, model_kwargs, options = fabric_parts(model_name, zoff_options, layers, checkpointing, seq)
        return run_fabric(run, family, model_kwargs, ADAMW, options, data_module, accumulate=accumulate, steps=steps,
                          warmup=warmup, batch=batch, devices=devices, block_size=cfg["block_size"],
                          zoff_options=zoff_options, inexact_because=inexact_because(name, zoff_options), clip=clip)
    build_module, strategy, precision = build_run(name, model_name, zoff_options, accumulate, ratio, layers,
                                                  checkpointing, seq)
    # DeepSpeed counts every micro-batch as an optimizer step (Lightning calls its step after each)
    steps_per_window = accumulate if getattr(strategy, "handles_gradient_accumulation", False) else 1
    timer = WindowTimer(accumulate, windows=steps + warmup)

    def measure() -> None:  # at the end of training, before the strategy's teardown: a run cut there keeps it
        report(measured_run(run, zoff_options, trainer, timer, module, params, warmup=warmup, clip=clip,
                            devices=devices, tokens_a_step=devices * batch * accumulate * cfg["block_size"]))

    trainer = pl.Trainer(accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=devices, strategy=strategy,
                         precision=precision,
                         max_steps=(steps + warmup) * steps_per_window, accumulate_grad_batches=accumulate,
                         gradient_clip_val=clip,
                         callbacks=[timer, AtTrainEnd(measure)], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    module = build_module(trainer)
    params = sum(p.numel() for p in module.parameters())
    trainer.fit(module, datamodule=data_module)
    return None  # `measure` reported the entry when training ended


def measured_run(run: BenchRun, zoff_options: dict, trainer: Any, timer: Any, module: Any, params: int, *,
                 warmup: int, clip: float | None, devices: int, tokens_a_step: int) -> dict:
    """The entry of a run that trained (`timer`: its WindowTimer), its `warmup` steps left out of the medians;
    `tokens_a_step`: all ranks' together."""
    from zoffbench.recorders import expandable_segments_in_use, process_peaks, retries_per_step

    name = run.name
    measured = slice(warmup, None)
    step_s = statistics.median(timer.steps[measured])
    norms = [t["zoff/grad_norm"] for t in timer.zoff if "zoff/grad_norm" in t]
    tokens_per_s = tokens_a_step / step_s
    # zoff's phase times arrive a step late on CUDA (StepTimer): a step may lack them
    zoff = {key: statistics.median(t[key] for t in timer.zoff[measured] if key in t) for key in timer.zoff[-1]}
    # zoff's own count includes the forwards that waited for overlapped updates; the callback's brackets only
    # the step call, which is the whole update for the others
    exposed = zoff.get("zoff/exposed_optimizer_s", statistics.median(timer.optimizer[measured]))
    if "zoff/forward_s" in zoff and "zoff/backward_s" in zoff:  # those waits moved out of the forward
        forward, backward, phase_source = zoff["zoff/forward_s"], zoff["zoff/backward_s"], "zoff telemetry"
    else:
        forward, backward = statistics.median(timer.forward[measured]), statistics.median(timer.backward[measured])
        phase_source = "callback"
    deepspeed_config = None
    if name in DEEPSPEED_RUNS:  # what DeepSpeed got, Lightning's additions included
        deepspeed_config = json.loads(json.dumps(cast("DeepSpeedStrategy", trainer.strategy).config, default=str))
    measurement = StepMeasurement(
        step_s_median=step_s, step_s_mean=statistics.fmean(timer.steps[measured]), devices=devices,
        rank=trainer.global_rank,
        tokens_per_s=tokens_per_s, model_tflops=6 * params * tokens_per_s / 1e12,
        forward_s=forward, backward_s=backward, exposed_optimizer_s=exposed,
        other_s=step_s - forward - backward - exposed, gpu_busy_fraction=(forward + backward) / step_s,
        phase_source=phase_source,
        telemetry_median=zoff,
        gpu_gb_after_micro_backward=statistics.median(timer.after_backward) if timer.after_backward else None,
        window_peak_gpu_gb=statistics.median(timer.window_peak[measured]) if timer.window_peak else None,
        **process_peaks(), gpu_expandable_segments=expandable_segments_in_use(),
        clipped_fraction=clipped_fraction(norms[measured], clip), grad_norms=norms,
        telemetry_steps={key: [t.get(key) for t in timer.zoff] for key in timer.zoff[-1]} if timer.zoff else None,
        setup_s=(timer.first_step_at or time.time()) - psutil.Process().create_time(), reported_at=time.time(),
        host_floor=host_floor(trainer.strategy, zoff, step_s),
        params=params, steps=timer.steps, forward=timer.forward, backward=timer.backward, zoff_options=zoff_options,
        memory=getattr(trainer.strategy, "memory_report", None), inexact_because=inexact_because(name, zoff_options),
        deepspeed_config=deepspeed_config, recomputed_blocks=recomputed_blocks(trainer.strategy, module),
        gpu_alloc_retries_per_step=retries_per_step(timer.alloc_retries, timer.retries_before_first),
        gpu_reserved_by_stream=timer.reserved_by_stream, gpu_alloc_retry_causes=timer.retry_causes,
        gpu_step_peak=timer.step_peak, gpu_idle=timer.gpu_idle,
        after_placement_pause=after_placement_pause(timer.zoff, warmup) or None)
    return run.entry(**measurement.fields())


def recomputed_blocks(strategy: Any, module: Any) -> int | None:
    """zoff's: the modules whose activations are recomputed at the end of fit (what "auto" chose, or the option)."""
    from lightning_zoff import ZoffStrategy
    from lightning_zoff._compat import recomputes_activations

    if not isinstance(strategy, ZoffStrategy):
        return None
    return sum(recomputes_activations(m) for m in module.modules())
