"""Every option of zoff in one frozen, typed dataclass: its default, its one-line doc, its check.

Each front door's strategy (`ZoffStrategy(**options)`, `ZoffFabricStrategy(**options)`) builds a `ZoffConfig` (refusing
a bad value with the field's name and what it accepts), and the engine, the memory plan and the checkpoints read the
options from it under the same names. README.md's option table is `markdown_table()` and `conf/strategy/zoff.yaml`
lists every field (tests/test_config.py holds them to it).
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, field, fields
from datetime import timedelta
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.constants import default_pg_timeout

StartMethod = Literal["subprocess", "fork", "spawn", "forkserver"]
ACCUM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ParamInitFn = Callable[[nn.Module], None]
ModuleClasses = frozenset[type[nn.Module]]


def option(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class ZoffConfig:
    """zoff's options, as `ZoffStrategy(**options)` and `ZoffFabricStrategy(**options)` take them; a value it does
    not accept raises TypeError or ValueError naming the option and what it accepts."""

    offload: bool = option(True, "fp32 master weights and optimizer state on the host, updated by the CPU; false: on"
                                 " the accelerator (`\"zoff_no_offload\"`)")
    accelerator_state: str | float = option(
        "auto", "with `offload`, how much of that state the GPU keeps instead, per unit: `\"auto\"` (what the host"
                " cannot hold, then as much as a step's measured peak leaves room for), a fraction of the trained"
                " parameters (the units the forward enters first), or `\"none\"`")
    accelerator_update_share: str | float = option(
        "auto", "with `offload`, the share of the host units' updates the accelerator runs after each step's decision"
                " (their state streamed up in pieces and back, while the CPU updates the rest): `\"auto\"` (split by"
                " the measured speed of both on a GPU; none on a CPU), a fraction of the host units' parameters, or"
                " `\"none\"`")
    wrap_policy: ModuleClasses | None = option(
        None, "module classes that become FSDP2 units; default: the repeated children of every `nn.ModuleList`; what"
              " they leave goes to the modules with a forward that hold it (containers and transformers, LitGPT or"
              " example models walked into, tied modules one unit)")
    activation_checkpointing_policy: ModuleClasses | Literal["auto"] | int = option(
        "auto", "module classes recomputed in backward instead of keeping their activations; `\"auto\"`: all blocks"
                " when the GPU cannot hold all the optimizer state beside the model and the traced step, else the"
                " fewest first blocks that let it (none where the step fits as it is); but where a block's recompute"
                " costs more than the host's update of the state its activations displace (measured at setup: many"
                " micro-batches a step), the fewest with which the model fits at all; a number N: the first N blocks"
                " in forward order, the others keep theirs; none: `None`")
    reshard_after_forward: bool = option(
        True, "FSDP2's: each unit gives its gathered parameters up after its forward and gathers them again in"
              " backward; false: keeps them until its backward (no all-gather in backward: less of the host's time"
              " and of the accelerator's copying a step, the whole model's 16-bit parameters more on the accelerator"
              " at the step's peak, in the plan)")
    staging_ring_units: int | Literal["auto"] = option(
        "auto", "with `overlap` and windows of several micro-batches summed on the host: the host units' shared pinned"
                " ring their gradient shards land in, in units of the largest one's landing (backward waits where the"
                " host's sums fall that far behind); 0: a landing buffer per host unit; \"auto\": a buffer per unit"
                " where the plan fits with them, else a ring of 3")
    start_method: StartMethod = option(
        "subprocess", "how ranks start: Lightning's script re-run, or `\"fork\"`/`\"spawn\"`/`\"forkserver\"`"
                      " multiprocessing (fork is the fast choice on CPU)")
    weights_to_main_process: bool = option(
        False, "with fork/spawn: after `fit`, gather the trained fp32 weights into the main process's module (every"
               " rank holds the whole model for it)")
    pin_memory: bool = option(True, "pinned host buffers; if the OS refuses (memlock), a warning and pageable memory")
    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] = option(
        "fp32", "dtype of a window's gradient sum: `\"fp32\"` (exact) or the model's 16-bit dtype (half the bytes)")
    optimizer_state_dtype: Literal["fp32", "bf16"] = option(
        "fp32", "dtype of the moments (Adam's two, Lion's one): `\"fp32\"` or `\"bf16\"` (2 B each, computed in fp32"
                " and stored rounded to nearest even; the master stays fp32)")
    grad_accum_on: Literal["host", "accelerator"] = option(
        "host", "where a window's sum lives between micro-batches: `\"host\"` or `\"accelerator\"` (the host gets"
                " it once, at the window's end); same bits")
    retain_gpu_grad_partition_until_step: bool = option(
        False, "with `grad_accum_on=\"accelerator\"`: keep the sum there for the whole window instead of parking it"
               " on the host between micro-batches")
    cpu_threads: int | None = option(None, "threads of this rank's CPU kernels; default: the cores this process may"
                                           " use divided by the ranks on its node")
    overlap: bool = option(
        True, "host work on a worker thread while the accelerator computes: speculative updates during backward into"
              " spare sets the host has room for, each unit's forward waiting only for its own update; same bits")
    process_group_backend: str | None = option(
        None, "default: `\"cpu:gloo,cuda:nccl\"` on GPU (host tensors need gloo), `\"gloo\"` on CPU")
    timeout: timedelta | None = option(default_pg_timeout, "how long a collective waits for the other ranks (None:"
                                                           " torch's default)")
    state_dict_type: Literal["sharded", "full"] = option(
        "sharded", "checkpoints: `\"sharded\"` (a directory, one file per rank, resumable at any world size) or"
                   " `\"full\"` (one file from rank 0, loadable without zoff)")
    loader_workers: int | None = option(
        None, "DataLoader worker processes per rank the host plan keeps room for (1 GiB each); default: the"
              " `num_workers` of the DataLoader given to `fit` (or of the DataModule or LightningModule that holds"
              " one), else 0")
    host_memory_floor: float | None = option(
        None, "GB of available host memory under which zoff stops the run itself at the next step, with one line,"
              " before the OS's OOM killer would end it; default: 2% of the host's memory, at least 0.5 GiB")
    param_init_fn: ParamInitFn | None = option(
        None, "`callable(module)` that initialises a module built on the meta device, a unit at a time; default:"
              " the module's `init_module_weights`, Hugging Face's `_init_weights`, or `reset_parameters()`")

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: the checks store the normal form of what the user wrote
        for name in ("offload", "weights_to_main_process", "pin_memory", "retain_gpu_grad_partition_until_step",
                     "overlap", "reshard_after_forward"):
            if not isinstance(getattr(self, name), bool):  # YAML's `offload: no` must not become True
                raise TypeError(f"ZoffStrategy({name}={getattr(self, name)!r}): expected true or false.")
        set_(self, "accelerator_state", parse_accelerator_state(self.accelerator_state))
        set_(self, "accelerator_update_share", parse_update_share(self.accelerator_update_share))
        _one_of("start_method", self.start_method, ("subprocess", "fork", "spawn", "forkserver"))
        _one_of("grad_accum_dtype", self.grad_accum_dtype, sorted(ACCUM_DTYPES))
        _one_of("optimizer_state_dtype", self.optimizer_state_dtype, ("fp32", "bf16"),
                " (the moments in 2 bytes each instead of 4; the master weights stay fp32)")
        _one_of("grad_accum_on", self.grad_accum_on, ("host", "accelerator"))
        _one_of("state_dict_type", self.state_dict_type, ("sharded", "full"))
        threads = self.cpu_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise TypeError(f"ZoffStrategy(cpu_threads={threads!r}): expected a positive integer, or None for the cores"
                            " this process may use divided by the ranks on its node.")
        workers = self.loader_workers
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
            raise TypeError(f"ZoffStrategy(loader_workers={workers!r}): expected 0 or more DataLoader workers per"
                            " rank, or None to read them from the DataLoader.")
        ring = self.staging_ring_units
        if ring != "auto" and (isinstance(ring, bool) or not isinstance(ring, int) or ring < 0):
            raise TypeError(f"ZoffStrategy(staging_ring_units={ring!r}): expected \"auto\", 0 (a landing buffer per"
                            " host unit) or a positive number of the largest host unit's landings.")
        floor = self.host_memory_floor
        if floor is not None and (isinstance(floor, bool) or not isinstance(floor, (int, float)) or floor < 0):
            raise TypeError(f"ZoffStrategy(host_memory_floor={floor!r}): expected GB of host memory (0 or more), or"
                            " None for 2% of the host's memory.")
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise TypeError(f"ZoffStrategy(param_init_fn={self.param_init_fn!r}): expected a callable(module), or"
                            " None.")
        set_(self, "wrap_policy", _classes("wrap_policy", self.wrap_policy) or None)
        policy = self.activation_checkpointing_policy
        if isinstance(policy, int) and not isinstance(policy, bool):
            if policy < 0:
                raise ValueError(f"activation_checkpointing_policy={policy}; a number of blocks is 0 or more.")
        elif policy != "auto":
            set_(self, "activation_checkpointing_policy", _classes("activation_checkpointing_policy", policy))

    @property
    def moment_dtype(self) -> torch.dtype:
        return MOMENT_DTYPES[self.optimizer_state_dtype]

    @property
    def grad_sum_dtype(self) -> torch.dtype:
        """The dtype of a window's gradient sum (`grad_sum`), as `grad_accum_dtype` names it."""
        return ACCUM_DTYPES[self.grad_accum_dtype]

    @property
    def host_worker(self) -> bool:
        """Host work runs on a worker thread beside the accelerator, host units updating during backward into spare
        sets (`overlap`, with state on the host)."""
        return self.overlap and self.offload


# options zoff once had, and why each went: both doors (`doors.FrontDoor`), the main job's overrides and the CLI refuse
# them by name with `removed_option`'s line
REMOVED_OPTIONS = {
    "update_lag": "a one-step-stale update ended 19% above exact training on the main job at step 200, 7% even after"
                  " 150 exact steps",
}


def removed_option(name: str) -> str | None:
    """Why option `name` is gone, in one line that points at its measurement; None for a name zoff never removed."""
    why = REMOVED_OPTIONS.get(name)
    return None if why is None else f"the option was removed: {why} (bench/README.md, \"`{name}`, removed\")"


def parse_accelerator_state(value: object) -> str | float:
    """"auto", "none" or a fraction in [0, 1], as the user may write it (YAML gives strings and numbers)."""
    return _auto_none_or_fraction(
        "accelerator_state", value, "a fraction of the optimizer state between 0 and 1 (e.g. 0.5: the first half of"
                                    " the model's units keep theirs on the GPU)")


def parse_update_share(value: object) -> str | float:
    """`accelerator_update_share` as the user may write it: "auto", "none" or a fraction in [0, 1]."""
    return _auto_none_or_fraction(
        "accelerator_update_share", value, "a fraction of the host units' parameters between 0 and 1 (e.g. 0.5: the"
                                           " GPU runs about half of the host's updates each step)")


def _auto_none_or_fraction(name: str, value: object, fraction_means: str) -> str | float:
    if isinstance(value, str) and value.strip().lower() in ("auto", "none"):
        return value.strip().lower()
    try:
        fraction = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        fraction = -1.0
    if isinstance(value, bool) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{name}={value!r}; choose 'auto', 'none' or {fraction_means}.")
    return "none" if fraction == 0.0 else fraction


def _one_of(name: str, value: Any, allowed: Iterable[Any], why: str = "") -> None:
    allowed = [repr(a) for a in allowed]
    if repr(value) not in allowed:
        choices = ", ".join(allowed[:-1]) + " or " + allowed[-1]
        raise ValueError(f"{name}={value!r}; choose {choices}{why}.")


def _classes(name: str, value: Any) -> frozenset[type[nn.Module]]:
    classes = frozenset(value or ())
    if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"ZoffStrategy({name}={value!r}): expected module classes, e.g. {{MyBlock}}.")
    return classes


def options_doc() -> str:
    """The Google-style "Args:" section of every option, from the fields' docs: what `help()`, pydoc and the CLI's
    `--help` (jsonargparse reads it) show for each option of the classes `with_options_doc` marks."""
    lines = ["Args:"]
    for f in fields(ZoffConfig):
        lines += textwrap.wrap(f"{f.name}: {f.metadata['doc']}", width=116, initial_indent="    ",
                               subsequent_indent="        ", break_on_hyphens=False)
    return "\n".join(lines)


def with_options_doc(cls: type) -> type:
    """`cls` with `options_doc()` after its docstring: the option meanings have one source, the fields' docs."""
    cls.__doc__ = f"{inspect.cleandoc(cls.__doc__ or '')}\n\n{options_doc()}\n"
    return cls


def defaults() -> dict[str, Any]:
    return {f.name: f.default for f in fields(ZoffConfig) if f.default is not MISSING}


def markdown_table() -> str:
    """README's option table: every field, its default and its doc."""
    rows = ["| option | default | meaning |", "| --- | --- | --- |"]
    for f in fields(ZoffConfig):
        default = "30 min" if isinstance(f.default, timedelta) else f"`{f.default!r}`"
        rows.append(f"| `{f.name}` | {default} | {f.metadata['doc']} |")
    return "\n".join(rows)


with_options_doc(ZoffConfig)


if __name__ == "__main__":
    print(markdown_table())
