"""What the scripts share: child processes and their results, the resident memory of a process tree, how a failed run
ended, and the schema of scripts/bench/bench.py's results.

- `run_command` runs a command and `run_function` a top-level function of a file (a script, a test module) in a fresh
  Python process; Lightning's launchers re-run that command line for the other ranks. Either samples the resident
  memory of the whole process tree, kills the tree at a timeout, and returns a `ChildRun`. A child hands back what it
  measured with `report(result)` (what `run_function`'s function returns is reported for it): each rank's result is
  pickled into the directory the parent names in $ZOFF_HARNESS_RESULTS and comes back in `ChildRun.results`, by rank.
  `call(fn, **kwargs)` is the short form: what `fn` returned on each rank, or an exception with the output's tail.
- `RssSampler`: the peak resident memory of a process, or of it and all its descendants, sampled by a thread.
- `failure_line` and `outcome_of`: a failed run's cause in one line, and in one word.
- `parse_options`: ZoffStrategy options from `key=value` strings (the models by name: model_shapes.py).
- `BenchRun`, `StepMeasurement`, `RunFailure`: what each entry of scripts/bench/bench.py's JSON holds.

No torch here (psutil and the standard library): a parent that measures its children stays small, and Linux
carries a process's peak RSS into the children it forks. The Lightning callbacks that record steps are in
recorders.py, the file every benchmark writes in results.py. This package, zoffbench, is the scripts' library: the
scripts of scripts/bench/ and scripts/checks/ import it (`from zoffbench.harness import call`) as they import
lightning_zoff, from the environment: the checkout installed (`pip install -e .`), or on PYTHONPATH as
scripts/device/gpu_checks.sh sets it.

    python -m zoffbench.serve ROOT MODULE FUNCTION KWARGS_JSON    # run_function's child: MODULE.FUNCTION(**KWARGS)
"""

from __future__ import annotations

import ast
import collections
import concurrent.futures
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import pickle
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import IO, Any, Literal

import psutil

RESULTS_ENV = "ZOFF_HARNESS_RESULTS"

# -- options -------------------------------------------------------------------------------------------------------


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """`key=value` strings into ZoffStrategy keyword arguments; values are Python literals (False, 8) or strings."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--zoff-option {pair!r}: expected key=value, for example overlap=False")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options


# -- resident memory -----------------------------------------------------------------------------------------------


class RssSampler:
    """The resident memory of process `pid` (default: this one) and, with `tree`, of all its descendants, summed, read
    by a thread every `interval_s` while the block runs: `before` (at entry), `peak`, `after` (at exit) in bytes, each
    process's own peak in `peak_by_pid`, and the block's `seconds`. Pinned and shared memory count in every process
    that maps it (a forked DataLoader worker counts its parent's pages again); a process that has ended counts 0.

    With `pss_interval_s`, a second thread sums the tree's proportional set size (PSS: a page shared by n processes
    counts 1/n in each, so the sum counts it once) every `pss_interval_s`: `peak_pss`, and `pss_read_s`, the longest
    pass. A pass reads /proc/PID/smaps_rollup, which walks each process's page tables (about 10 ms per GB resident
    here), hence its own, slower thread."""

    def __init__(self, pid: int | None = None, interval_s: float = 0.5, tree: bool = True,
                 pss_interval_s: float | None = None) -> None:
        self.pid, self.interval_s, self.tree = os.getpid() if pid is None else pid, interval_s, tree
        self.pss_interval_s = pss_interval_s
        self.before = self.peak = self.after = 0
        self.peak_pss, self.pss_read_s = 0, 0.0
        self.peak_by_pid: dict[int, int] = {}
        self.seconds = 0.0
        self.samples = 0  # taken so far
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._sample_until_stopped, name="harness-rss", daemon=True)]
        if pss_interval_s is not None:
            self._threads.append(threading.Thread(target=self._sample_pss_until_stopped, name="harness-pss",
                                                  daemon=True))
        self._started = 0.0

    def _members(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)] if self.tree else [root]
        except psutil.Error:
            return []

    def sample_pss(self) -> int:
        """The proportional set size now, summed over the process (and its tree)."""
        started, total = time.perf_counter(), 0
        for member in self._members():
            with contextlib.suppress(psutil.Error):
                total += member.memory_full_info().pss
        self.pss_read_s = max(self.pss_read_s, time.perf_counter() - started)
        self.peak_pss = max(self.peak_pss, total)
        return total

    def sample(self) -> int:
        """The memory now, summed over the process (and its tree)."""
        total = 0
        for member in self._members():
            try:
                rss = member.memory_info().rss
            except psutil.Error:
                continue
            total += rss
            self.peak_by_pid[member.pid] = max(self.peak_by_pid.get(member.pid, 0), rss)
        self.peak = max(self.peak, total)
        self.samples += 1
        return total

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def _sample_pss_until_stopped(self) -> None:
        assert self.pss_interval_s is not None
        while not self._stop.wait(self.pss_interval_s):
            self.sample_pss()

    def __enter__(self) -> RssSampler:
        self._started = time.perf_counter()
        self.before = self.sample()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._started
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self.after = self.sample()


def kill_tree(pid: int) -> None:
    """SIGKILL process `pid` and all its descendants, the descendants first, and wait (a few seconds at most) until the
    descendants are gone: a signal is delivered when its process next runs, so on busy cores a killed grandchild was
    still "running" when the run's own wait returned (test_a_timeout_kills_the_whole_tree failed so once in CI). The
    root is its parent's to wait for (`Popen.wait`): waiting here would reap it and lose its exit status."""
    try:
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for member in reversed(members):
        with contextlib.suppress(psutil.Error):
            member.kill()
    psutil.wait_procs(members[1:], timeout=5)


# -- how a run failed ----------------------------------------------------------------------------------------------

# the line of a traceback that names the exception: "torch.OutOfMemoryError: CUDA out of memory. ...",
# "RuntimeError: ...", "AssertionError", zoff's refusals ("...memory_plan.PlanDoesNotFit: zoff: ..."); torch prefixes
# each line a rank prints with "[rank0]: "
EXCEPTION_LINE = re.compile(r"^(\[rank\d+\]: ?)?[\w.]*(Error|Exception|Exit|Interrupt|DoesNotFit|MemoryLow)\b(:|$)")
# lines that name the cause, whatever failed after it: the GPU out of memory, a DataLoader worker the kernel killed
# (the training process then fails with "DataLoader worker (pid(s) ...) exited unexpectedly")
CAUSE_LINES = ("CUDA out of memory", "is killed by signal: Killed")


def failure_line(stderr: str, returncode: int) -> str:
    """The last meaningful line of a failed run: its cause (`CAUSE_LINES`), else its last exception line, else how it
    ended."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    line = next((line for line in reversed(lines) if any(cause in line for cause in CAUSE_LINES)), None)
    line = line or next((line for line in reversed(lines) if EXCEPTION_LINE.match(line)), None)
    if line is None and returncode < 0:
        line = f"killed by {signal.Signals(-returncode).name}"
        if -returncode == signal.SIGKILL:
            line += " (the kernel's OOM killer? host memory)"
    if line is None:
        line = lines[-1] if lines else f"exit code {returncode}, nothing on stderr"
    return line[:600]


def zoff_lines(output: str, most: int = 20) -> list[str]:
    """zoff's own lines in a run's output, as its node logged them: the plan's step, the blocks recomputed and why,
    where the state went."""
    return [line[line.index("zoff rank"):] for line in output.splitlines() if "zoff rank" in line][:most]


def outcome_of(error: str) -> str:
    """"refused" (zoff's plan, at setup), "gpu_oom", "host_oom", "timeout" or "error" for a failure_line."""
    if "PlanDoesNotFit" in error:
        return "refused"
    if "CUDA out of memory" in error:
        return "gpu_oom"
    # a DataLoader worker the kernel killed: the training process raises "... is killed by signal: Killed."
    if any(sign in error for sign in ("DefaultCPUAllocator", "can't allocate memory", "SIGKILL", "signal: Killed")):
        return "host_oom"
    if error.startswith("timed out"):
        return "timeout"
    return "error"


# -- child processes -----------------------------------------------------------------------------------------------

# "inherit": the child writes to this process's stdout and stderr; "echo": its stdout and stderr, merged, are copied
# there line by line and the last lines kept; "capture": both kept whole, apart, and not shown
Output = Literal["inherit", "echo", "capture"]


class ChildFailed(RuntimeError):
    pass


@dataclass
class ChildRun:
    """How a child process ended, what its tree held at most and what its ranks reported."""

    command: list[str]
    output: Output
    returncode: int
    timeout_s: float | None
    timed_out: bool  # killed, with its whole tree, after timeout_s
    wall_s: float
    ended_at: float  # the epoch time the process was seen to end (its exit's cost: this less its last report's time)
    peak_tree_rss: int  # bytes, the tree's sum; 0 if it ended before the first sample
    peak_rss_by_pid: dict[int, int]
    peak_tree_pss: int | None  # bytes, the tree's PSS summed (shared pages once); None unless sampled
    pss_read_s: float | None  # the longest PSS pass over the tree
    results: dict[int, Any]  # what each rank reported, by rank
    stdout: str  # "capture": all of it; "echo": the last lines of stdout and stderr; "inherit": ""
    stderr: str  # "capture" only

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def failure(self) -> str:
        """The cause of a failure in one line (see failure_line)."""
        if self.timed_out:
            return f"timed out after {self.timeout_s} s"
        return failure_line(self.stderr if self.output == "capture" else self.stdout, self.returncode)

    def check(self) -> ChildRun:
        """This run, or ChildFailed with the end of its output if it failed."""
        if not self.ok:
            how = f"timed out after {self.timeout_s} s" if self.timed_out else f"exited with {self.returncode}"
            raise ChildFailed(f"{shlex.join(self.command)} {how}:\n{self.stdout[-6000:]}{self.stderr[-6000:]}")
        return self


def run_command(command: list[str], *, output: Output = "inherit", timeout_s: float | None = None,
                env: dict[str, str] | None = None, cwd: str | Path | None = None,
                interval_s: float = 0.5, pss_interval_s: float | None = None) -> ChildRun:
    """Run `command` to its end, sampling its tree's memory every `interval_s` (and its PSS every `pss_interval_s`,
    see RssSampler); past `timeout_s` the tree is killed.
    With output="echo" it returns once every process holding the output pipe has exited (a run's other ranks are
    children of the first and share it)."""
    env = {**(os.environ if env is None else env)}
    tail: collections.deque[str] = collections.deque(maxlen=60)
    with tempfile.TemporaryDirectory(prefix="harness_") as results, contextlib.ExitStack() as files:
        env[RESULTS_ENV] = results
        streams: dict[str, Any] = {}
        if output == "echo":
            env.setdefault("PYTHONUNBUFFERED", "1")  # progress lines as they come
            streams = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        elif output == "capture":
            streams = dict(stdout=files.enter_context(tempfile.TemporaryFile("w+")),
                           stderr=files.enter_context(tempfile.TemporaryFile("w+")))
        started, killed = time.perf_counter(), threading.Event()
        proc = subprocess.Popen(command, env=env, cwd=cwd, text=True, errors="replace", **streams)

        def kill() -> None:
            killed.set()
            kill_tree(proc.pid)

        timer = threading.Timer(timeout_s, kill) if timeout_s is not None else None
        with RssSampler(proc.pid, interval_s, pss_interval_s=pss_interval_s) as rss:
            if timer is not None:
                timer.start()
            if output == "echo":
                assert proc.stdout is not None
                for line in proc.stdout:
                    sys.stdout.write(line)
                    tail.append(line)
            proc.wait()
            ended_at = time.time()
            if timer is not None:
                timer.cancel()
        wall_s = time.perf_counter() - started
        stdout, stderr = "".join(tail), ""
        if output == "capture":
            stdout, stderr = _read(streams["stdout"]), _read(streams["stderr"])
        reported = {}
        for path in Path(results).glob("rank*.pkl"):
            with path.open("rb") as file:
                reported[int(path.stem.removeprefix("rank"))] = pickle.load(file)
    return ChildRun(command=list(command), output=output, returncode=proc.returncode, timeout_s=timeout_s,
                    timed_out=killed.is_set(), wall_s=wall_s, ended_at=ended_at, peak_tree_rss=rss.peak,
                    peak_rss_by_pid=rss.peak_by_pid,
                    peak_tree_pss=rss.peak_pss if pss_interval_s is not None else None,
                    pss_read_s=rss.pss_read_s if pss_interval_s is not None else None,
                    results=dict(sorted(reported.items())), stdout=stdout, stderr=stderr)


def _read(file: IO[str]) -> str:
    file.seek(0)
    return file.read()


def run_function(fn: Callable[..., Any], kwargs: dict[str, Any] | None = None, **options: Any) -> ChildRun:
    """`fn(**kwargs)` in a fresh process (`run_command`'s `options`): `fn` is a top-level function of a file, `kwargs`
    JSON values. What it returns on a rank, unless None, is that rank's result; a function that returns None reports
    for itself (`report`), from a rank it forked for instance."""
    root, name = _importable_as(sys.modules[fn.__module__])
    command = [sys.executable, "-m", "zoffbench.serve", str(root), name, fn.__name__, json.dumps(kwargs or {})]
    return run_command(command, **options)


def call(fn: Callable[..., Any], **kwargs: Any) -> list[Any]:
    """What `fn(**kwargs)` returned in a fresh process, on each rank in rank order; its output echoed. Raises
    ChildFailed with the output's last lines if the process failed."""
    return list(run_function(fn, kwargs, output="echo").check().results.values())


def call_each(fn: Callable[..., Any], kwargs_by_name: dict[str, dict[str, Any]]) -> dict[str, list[Any]]:
    """`call(fn, **kwargs)` for each name's kwargs, all at once, each in its own process with its own MASTER_PORT: the
    GPU checks' modes are small runs whose time is mostly a process's start, so they run side by side. Their echoed
    output interleaves."""
    def one(kwargs: dict[str, Any], port: int) -> list[Any]:
        env = {**os.environ, "MASTER_PORT": str(port)}
        return list(run_function(fn, kwargs, output="echo", env=env).check().results.values())

    ports = free_ports(len(kwargs_by_name))
    with concurrent.futures.ThreadPoolExecutor(len(kwargs_by_name)) as pool:
        futures = {name: pool.submit(one, kwargs, port)
                   for (name, kwargs), port in zip(kwargs_by_name.items(), ports, strict=True)}
        return {name: future.result() for name, future in futures.items()}


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free a moment ago (each held while the next is picked), for runs started at once:
    Lightning's forking launchers leave MASTER_PORT set in their process, which every interpreter started from it would
    otherwise share."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def report(result: Any, rank: int | None = None) -> None:
    """Hand `result` (anything pickle takes: dicts, tensors) to the parent as rank `rank`'s; by default LOCAL_RANK's,
    which Lightning's launchers set in every rank of a run of several devices (one device runs without it)."""
    directory = os.environ.get(RESULTS_ENV)
    if directory is None:
        raise RuntimeError(f"report() needs ${RESULTS_ENV}: run this through harness.run_command or run_function")
    rank = int(os.environ.get("LOCAL_RANK", "0")) if rank is None else rank
    path = Path(directory) / f"rank{rank}.pkl"
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with partial.open("wb") as file:
        pickle.dump(result, file)
    partial.replace(path)  # whole or not at all


def _importable_as(module: ModuleType) -> tuple[Path, str]:
    """The directory `module` is imported from and its name there: a package's module under its dotted name from the
    package's parent, a script run by its path (`__main__`) or a test module under the file's stem from its own
    directory, as Python and pytest import them."""
    file = Path(module.__file__ or "").resolve()
    spec = module.__spec__
    name = spec.name if spec is not None else file.stem
    depth = name.count(".") + (file.name == "__init__.py")
    return file.parents[depth], name


def serve(root: str, name: str, function: str, kwargs: str) -> None:
    """The child of run_function (`python -m zoffbench.serve`): imports module `name` under the parent's name for it
    (so what it pickles unpickles in the parent) and reports what `function` returns. A script's or a test module's
    directory `root` goes first on sys.path, as when Python runs it (its neighbours import); a package this environment
    provides (zoffbench's modules) is imported as found, so that the checkout's root never comes before PYTHONPATH (a
    source tree measured there keeps its own lightning_zoff)."""
    if importlib.util.find_spec(name.partition(".")[0]) is None:
        sys.path.insert(0, root)
    result = getattr(importlib.import_module(name), function)(**json.loads(kwargs))
    if result is not None:
        report(result)


# -- scripts/bench/bench.py's results ------------------------------------------------------------------------------


def _fields(record: Any, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """A dataclass's fields as JSON keys, those named in `optional` only where set."""
    fields = dataclasses.asdict(record)
    return {key: value for key, value in fields.items() if key not in optional or value is not None}


@dataclass(frozen=True)
class BenchRun:
    """One run of scripts/bench/bench.py: the keys every entry of its JSON starts with, whether it trained or not."""

    name: str
    model: str
    layers: int | None  # the GPT's blocks; None for a Hugging Face preset
    activation_checkpointing: bool
    accumulate: int
    batch: int  # per device
    seq: int  # tokens a sequence
    num_workers: int  # the training DataLoader's worker processes (0: batches made in the training process)
    gpu_memory_gb: float | None  # the cap on torch's allocator; None: uncapped
    exact: bool  # AdamW's update of every parameter at every step in fp32 state
    gradient_clip_val: float | None  # the Trainer's (norm); None: not clipped
    ratio: float | None = None  # deepspeed_zero3_offload_ratio's offload_optimizer.ratio; no key elsewhere
    data: str = "random"  # "random" tokens (every step clips) or "text", the main job's corpus (clipping as it comes)

    def entry(self, **fields: Any) -> dict[str, Any]:
        return {**_fields(self, optional=("ratio",)), **fields}


@dataclass(frozen=True)
class StepMeasurement:
    """What a run that trained measured: medians over the optimizer steps after the warm-up, and each step's times."""

    step_s_median: float
    step_s_mean: float
    devices: int
    rank: int
    tokens_per_s: float  # all ranks together
    model_tflops: float  # 6 x parameters x tokens per second, all ranks together
    forward_s: float  # batch start to the loss, summed over the window's micro-batches
    backward_s: float  # the loss to on_after_backward, summed likewise
    exposed_optimizer_s: float  # the last backward's end to the optimizer step's end
    other_s: float  # the median step less forward, backward and exposed optimizer time: what the breakdown misses
    gpu_busy_fraction: float  # forward and backward time (the accelerator computing) over the median step
    phase_source: str  # "zoff telemetry" or "callback"
    telemetry_median: dict[str, float]
    gpu_gb_after_micro_backward: float | None
    window_peak_gpu_gb: float | None
    peak_gpu_gb: float  # torch.cuda.max_memory_allocated
    peak_gpu_reserved_gb: float  # torch.cuda.max_memory_reserved: what the allocator took from the GPU
    gpu_alloc_retries: int  # the allocator's retries after freeing its cache (each a synchronisation: slow steps)
    host_gb: float  # this rank's own peak resident memory
    setup_s: float  # from the process's start to its first step's
    reported_at: float  # the epoch time the measurement was made, after fit (bench.py's exit_s starts here)
    params: int
    steps: list[float]
    forward: list[float]
    backward: list[float]
    zoff_options: dict[str, Any]
    memory: dict[str, Any] | None  # zoff's memory report
    inexact_because: str | None = None
    deepspeed_config: dict[str, Any] | None = None  # the dict DeepSpeed got, Lightning's additions included
    host_floor: dict[str, float] | None = None  # zoff: the host update's bandwidth against the machine's (`host_floor`)
    recomputed_blocks: int | None = None  # zoff: the modules recomputing their activations at the end of fit
    gpu_expandable_segments: bool | None = None  # the CUDA allocator grew its segments in place (zoff asks it to)
    # of the measured steps, those whose gradient norm was clipped (zoff's telemetry; None without it or clipping):
    # a clipped step's host update waits for the norm, an unclipped one may have run during backward
    clipped_fraction: float | None = None
    grad_norms: list[float] | None = None  # each step's (warm-up included), the trace a clipping study reads
    # zoff's telemetry at each step's end (warm-up included; None where it lacks a key; on CUDA the phase times arrive a
    # step late): how the split, the exposed update and the host's update moved from step to step, which medians hide
    telemetry_steps: dict[str, list[float | None]] | None = None
    gpu_alloc_retries_per_step: list[int] | None = None  # each step's (warm-up included; setup's not counted)
    gpu_reserved_by_stream: dict[str, dict[str, float]] | None = None  # at the last step's end: where the cache sits
    gpu_alloc_retry_causes: list[dict[str, Any]] | None = None  # ZOFF_BENCH_ALLOC_HISTORY=1: `alloc_history.py`
    gpu_step_peak: dict[str, Any] | None = None  # ... the most the last steps' own blocks held, by stream and site
    gpu_idle: dict[str, Any] | None = None  # ZOFF_BENCH_PROFILE=1: the last step's idle GPU (`gpu_idle.py`)
    # torch's "active" peak: blocks allocated, or freed but not yet reusable (another stream's work on them pending),
    # which peak_gpu_gb no longer counts
    peak_gpu_active_gb: float | None = None
    # measured steps (indices into `steps`) right after a step whose placement paused the accelerator: the host's
    # update finished in that pause, so their first forward met none of it, a time no later step sees
    after_placement_pause: list[int] | None = None

    def fields(self) -> dict[str, Any]:
        return _fields(self, optional=("inexact_because", "deepspeed_config", "host_floor", "recomputed_blocks"))


PLACEMENT_PAUSE_S = 0.25  # a placement this long lets much of a 7B model's host update finish unseen (1x H100)


def after_placement_pause(telemetry: list[dict[str, float]], warmup: int) -> list[int]:
    """The measured steps (after `warmup`) whose previous step's placement (zoff's `placement_s`, the step's own, not
    late) held the accelerator idle at least PLACEMENT_PAUSE_S."""
    return [i for i in range(max(warmup, 1), len(telemetry))
            if telemetry[i - 1].get("zoff/placement_s", 0.0) >= PLACEMENT_PAUSE_S]


def clipped_fraction(norms: list[float], clip: float | None) -> float | None:
    """The share of steps whose gradient norm `clip` cut (as zoff clips: norm + 1e-6 > clip)."""
    if not norms or not clip:
        return None
    return sum(norm + 1e-6 > clip for norm in norms) / len(norms)


@dataclass(frozen=True)
class RunFailure:
    """A run that did not train: why, in one line and in one word."""

    error: str
    outcome: str  # "gpu_oom", "host_oom", "timeout", "error" or "unsupported"
    stderr_tail: str | None = None

    def fields(self) -> dict[str, Any]:
        return _fields(self, optional=("stderr_tail",))
