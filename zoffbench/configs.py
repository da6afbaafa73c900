"""Bench presets of the peers' headline configurations: a name for a set of scripts/bench/bench.py's arguments,
chosen with `--config NAME`. An argument also given on the command line wins over the preset's; the JSON records the
preset (`"config"`: its name, its arguments and whose configuration it is)."""

from __future__ import annotations

from typing import Any

# name: (bench.py's arguments by their argparse names, whose configuration and where it is published)
CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "megatrain_qwen25_7b": (
        dict(model="qwen25_7b", batch=8, accumulate=[18], seq=1024, num_workers=4, activation_checkpointing=True,
             zoff_option=["activation_checkpointing_policy='auto'"]),
        ("MegaTrain (arXiv 2604.05091), examples/sft/configs/qwen_7b.yaml: Qwen2.5-7B, sequence 1024, batch 148"
         " (151,552 tokens a step), 4 DataLoader workers, recompute; here batch 8 x 18 accumulated (147,456 tokens a"
         " step), every peer's blocks recomputed, zoff's as its default 'auto' chooses (recomputed_blocks)."
         " MegaTrain's own train.py there on 1x H100: 282.5 model TFLOP/s (issue 53)"),
    ),
}


def arguments(name: str) -> dict[str, Any]:
    """Preset `name`'s arguments, as argparse defaults."""
    return dict(CONFIGS[name][0])


def record(name: str | None) -> dict[str, Any] | None:
    """What the JSON keeps of preset `name` (None: no preset)."""
    if name is None:
        return None
    values, source = CONFIGS[name]
    return {"name": name, "arguments": values, "source": source}
