"""The core without Lightning: `ShardedTraining` driven directly on 2 gloo CPU ranks by a plain loop (shard, build the
engine, forward and backward with the window's end, step, checkpoints), in the order `contract.Core` states, against
torch's AdamW on one process with the whole model in fp32."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.compare import rel_err
from helpers.core_run import ACCUMULATE, MAX_NORM
from helpers.reference import train_on_one_process

pytestmark = pytest.mark.slow  # the ranks start in an interpreter of their own (the module's fixture)

TESTS = Path(__file__).resolve().parent
STEPS = 4


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each rank of `helpers.core_run` saw, started from a fresh interpreter (this one may hold Lightning)."""
    out = tmp_path_factory.mktemp("core")
    proc = subprocess.run([sys.executable, "-m", "helpers.core_run", str(out), str(STEPS)], cwd=TESTS,
                          env={**os.environ, "PYTHONPATH": str(TESTS)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(out / f"rank{rank}.pt") for rank in (0, 1)]


def test_the_ranks_never_import_lightning(ranks):
    assert [seen["lightning"] for seen in ranks] == [[], []]


def test_sharded_training_matches_torch_adamw_on_one_process(ranks):
    losses, weights = train_on_one_process(STEPS, ACCUMULATE, MAX_NORM)
    assert len(losses) == STEPS * ACCUMULATE
    for rank, seen in enumerate(ranks):
        assert rel_err(seen["losses"], [micro[rank] for micro in losses]) < 1e-5
        assert seen["skipped"] == [False] * STEPS
        assert min(seen["clip_coefs"]) < 1.0 == max(seen["clip_coefs"])  # clipping active on some steps only
        assert seen["weights"].keys() == weights.keys()  # the fp32 masters, whole on every rank
        for name, value in seen["weights"].items():
            assert value.dtype == torch.float32
            torch.testing.assert_close(value, weights[name], rtol=1e-4, atol=1e-5)
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0] - 0.2  # it learns, so the comparison means something


def test_a_checkpoint_saved_and_loaded_by_the_core_resumes_bit_for_bit(ranks):
    for seen in ranks:
        assert seen["resumed_losses"] == seen["losses"]
        for name, value in seen["weights"].items():
            assert torch.equal(seen["resumed_weights"][name], value), name
