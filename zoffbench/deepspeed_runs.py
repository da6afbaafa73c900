"""DeepSpeed's configurations for scripts/bench/bench.py: Lightning's `DeepSpeedStrategy` as users build it (ZeRO stage,
the optimizer offloaded to the CPU, pinned memory asked for explicitly) plus the keys that make each one stronger.
DeepSpeed is imported only when a run is built: this module loads on machines without it.

- deepspeed_zero3_offload: ZeRO-3, the fp32 master weights, moments and update on the CPU (DeepSpeedCPUAdam).
- deepspeed_zero2_offload: ZeRO-2, the same optimizer offload; the 16-bit parameters and gradients stay whole on every
  GPU, so the model is built as usual instead of under `deepspeed.zero.Init`.
- deepspeed_zero3_offload_ratio: ZeRO-3 with `offload_optimizer.ratio` r, ZeRO-Offload++ "Twin-Flow" (DeepSpeed PR
  #4636, merged 2023-11-06; any 0.13 or later has it): the optimizer state is cut into sub-groups of `sub_group_size`
  elements; the last r of them live and update on the CPU (DeepSpeedCPUAdam), the others stay on the GPU and update
  there (a torch.optim.AdamW that DeepSpeed builds from the first param group). The client optimizer must be exactly
  DeepSpeedCPUAdam (stage3.py asserts "Hybrid Optimizer Only Supports DeepSpeedCPUAdam"). Lightning's default
  sub_group_size (1e12) makes one sub-group, which the rule puts wholly on the CPU for any r > 0, hence the smaller
  one here. Not SuperOffload (`offload_optimizer.super_offload`, its own ZeRO-3 optimizer for GH200-class superchips,
  2025): that one speculates and rolls back algebraically, so it is not bit-exact.
- deepspeed_zero2_zenflow: ZeRO-2 + ZenFlow (`zero_optimization.zenflow`, DeepSpeed PR #7391, summer 2025; keys as
  in DeepSpeed's ZenFlow tutorial): each step updates only the top `topk_ratio` gradient columns on the GPU,
  accumulates the rest and applies it on the CPU every `update_interval` steps, overlapped with the next steps. Not
  AdamW's math, so inexact. It builds its optimizer from the config's `optimizer` section (the selective GPU
  optimizer takes its hyperparameters from there), so weight decay applies to every parameter there, not only to the
  matrices as in the other runs. ZenFlow replaces DeepSpeed's gradient_accumulation_steps with its update_interval,
  so it runs only at accumulate 1. (ZeRO-3 + ZenFlow crashed with a CUDA index out of bounds on our GPT.)
"""

from __future__ import annotations

import copy
import functools
from typing import cast

DEEPSPEED_RUNS = ("deepspeed_zero3_offload", "deepspeed_zero2_offload", "deepspeed_zero3_offload_ratio",
                  "deepspeed_zero2_zenflow")
ZERO_STAGE = {"deepspeed_zero3_offload": 3, "deepspeed_zero2_offload": 2, "deepspeed_zero3_offload_ratio": 3,
              "deepspeed_zero2_zenflow": 2}
INEXACT = frozenset({"deepspeed_zero2_zenflow"})
# 0.1, 0.2, ..., 1.0: the fraction of the optimizer state on the CPU that bench.py searches for the smallest that fits
RATIOS = tuple(round(0.1 * i, 1) for i in range(1, 11))
# sub-groups of 1e8 elements: 14 on the 1.34B GPT, 67 on the 6.7B, 130 on the 13B, so that r moves in small steps
RATIO_SUB_GROUP_SIZE = 100_000_000
ZENFLOW = dict(topk_ratio=0.05, select_strategy="auto", select_interval="auto", update_interval=4,
               full_warm_up_rounds=0, overlap_step=True)


def config_overrides(name: str, adamw: dict, ratio: float | None = None) -> dict:
    """What run `name` adds to Lightning's DeepSpeed config, merged into it key by key (`merge`)."""
    if name == "deepspeed_zero3_offload_ratio":
        if ratio is None:
            raise ValueError(f"{name} needs a ratio (the fraction of the optimizer state on the CPU)")
        return {"zero_optimization": {"sub_group_size": RATIO_SUB_GROUP_SIZE, "offload_optimizer": {"ratio": ratio}}}
    if name == "deepspeed_zero2_zenflow":
        params = dict(lr=adamw["lr"], betas=list(adamw["betas"]), eps=adamw["eps"], weight_decay=adamw["weight_decay"])
        return {"zero_optimization": {"zenflow": dict(ZENFLOW)}, "optimizer": {"type": "AdamW", "params": params}}
    if name in DEEPSPEED_RUNS:
        return {}
    raise ValueError(f"unknown DeepSpeed run {name!r}; known: {', '.join(DEEPSPEED_RUNS)}")


def merge(config: dict, overrides: dict) -> dict:
    """`overrides` into `config` in place, nested dicts key by key; returns `config`."""
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            merge(config[key], value)
        else:
            config[key] = copy.deepcopy(value)
    return config


def unsupported(name: str, accumulate: int) -> str | None:
    """Why run `name` cannot run at this accumulation, or None."""
    if name == "deepspeed_zero2_zenflow" and accumulate != 1:
        return ("ZenFlow replaces DeepSpeed's gradient_accumulation_steps with its update_interval: "
                "deepspeed_zero2_zenflow runs only at --accumulate 1")
    return None


def build_strategy(name: str, adamw: dict, accumulate: int, ratio: float | None = None):
    """Lightning's DeepSpeedStrategy for run `name` (its `config` is the dict DeepSpeed gets, once Lightning has added
    batch size, accumulation, clipping and precision at setup)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    refusal = unsupported(name, accumulate)
    if refusal:
        raise ValueError(refusal)
    strategy = DeepSpeedStrategy(stage=ZERO_STAGE[name], offload_optimizer=True, offload_optimizer_device="cpu",
                                 pin_memory=True)
    # __init__ loads a config given (or named in the environment) or builds one from the arguments: never None
    merge(cast(dict, strategy.config), config_overrides(name, adamw, ratio))
    return strategy


def optimizer_factory(name: str, adamw: dict):
    """The optimizer the LightningModule builds, or None where the config's `optimizer` section builds it."""
    if name == "deepspeed_zero2_zenflow":
        return None
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return functools.partial(DeepSpeedCPUAdam, **adamw, adamw_mode=True)
