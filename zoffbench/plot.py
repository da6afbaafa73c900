"""The runs of one scripts/bench/bench.py call drawn next to its JSON (same name, .png): per run, one horizontal bar of
the median optimizer step split into forward, backward, exposed optimizer time and the rest (clipping, data,
Lightning), and beside it the peak GPU memory and the host memory. Failed runs keep their row, with the error instead
of bars."""

from __future__ import annotations

from pathlib import Path

PHASES = (("forward_s", "forward", "#4c72b0"), ("backward_s", "backward", "#55a868"),
          ("exposed_optimizer_s", "exposed optimizer", "#c44e52"))
OTHER_COLOR = "#bbbbbb"


def step_segments(run: dict) -> dict[str, float]:
    """Seconds per phase of a run's median step, plus "other": what the phases leave of the step (never below 0)."""
    segments = {label: float(run.get(key) or 0.0) for key, label, _ in PHASES}
    segments["other"] = max(0.0, run["step_s_median"] - sum(segments.values()))
    return segments


def run_label(run: dict, with_model: bool = False) -> str:
    label = f"{run['name']} acc {run['accumulate']}"
    if run.get("ratio") is not None:
        label += f" ratio {run['ratio']}"
    if with_model:
        label = f"{run.get('model')} {label}"
    if run.get("exact") is False:
        label += " (inexact)"
    return label


def host_gb(run: dict) -> float:
    """The whole process tree's peak where the parent sampled it (ZenFlow's optimizer runs in a process of its own),
    else rank 0's own peak."""
    return float(run.get("host_tree_peak_gb") or run.get("host_gb") or 0.0)


def plot_runs(runs: list[dict], path: Path, title: str = "") -> Path | None:
    """Draw `runs` (bench.py's run entries) into the PNG `path`; None, with a note, where matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print(f"matplotlib is missing: no plot next to {path.with_suffix('.json').name}")
        return None
    with_model = len({run.get("model") for run in runs}) > 1
    fig = Figure(figsize=(13, 2.2 + 0.42 * max(len(runs), 1)), layout="constrained")
    FigureCanvasAgg(fig)
    time_ax, memory_ax = fig.subplots(1, 2, sharey=True, gridspec_kw=dict(width_ratios=(3, 2)))
    rows = list(range(len(runs) - 1, -1, -1))  # the first run on top
    for row, run in zip(rows, runs, strict=True):
        if "error" in run:
            time_ax.text(0, row, f" failed: {run['error'][:90]}", va="center", fontsize=7, color="firebrick")
            continue
        left = 0.0
        phases = (*PHASES, (None, "other", OTHER_COLOR))
        for (_, label, color), seconds in zip(phases, step_segments(run).values(), strict=True):
            time_ax.barh(row, seconds, left=left, color=color, label=label, height=0.7)
            left += seconds
        time_ax.text(left, row, f" {run['step_s_median']:.3f} s", va="center", fontsize=7)
    # one legend entry per phase, however many runs drew it
    handles, labels = time_ax.get_legend_handles_labels()
    by_label = dict(zip(labels, handles, strict=True))
    if by_label:
        time_ax.legend(by_label.values(), by_label.keys(), fontsize=8, ncol=4, loc="lower center",
                       bbox_to_anchor=(0.5, 1.0))
    steps = [run["step_s_median"] for run in runs if "error" not in run]
    time_ax.set_xlim(0, 1.15 * max(steps, default=1.0))  # room for the step's label after the longest bar
    time_ax.set_yticks(rows, [run_label(run, with_model) for run in runs], fontsize=8)
    time_ax.set_ylim(-0.6, len(runs) - 0.4)  # failed runs have no bar to stretch the axis to their row
    time_ax.set_xlabel("seconds per optimizer step (median after warmup)")
    time_ax.grid(axis="x", alpha=0.3)

    height = 0.38
    ok = [(row, run) for row, run in zip(rows, runs, strict=True) if "error" not in run]
    memory_ax.barh([row + height / 2 for row, _ in ok], [run.get("peak_gpu_gb") or 0.0 for _, run in ok], height,
                   color="#8172b2", label="peak GPU GB")
    memory_ax.barh([row - height / 2 for row, _ in ok], [host_gb(run) for _, run in ok], height, color="#ccb974",
                   label="host GB")
    caps = sorted({run["gpu_memory_gb"] for run in runs if run.get("gpu_memory_gb")})
    for cap in caps:  # the cap is in GiB, the bars in GB
        memory_ax.axvline(cap * 2**30 / 1e9, color="black", linestyle="--", linewidth=1, label=f"GPU cap {cap} GiB")
    memory_ax.legend(fontsize=8, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    memory_ax.set_xlabel("GB")
    memory_ax.grid(axis="x", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path
