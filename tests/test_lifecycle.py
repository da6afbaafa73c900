"""The default launcher (a subprocess per rank) through fit, validate, test, predict and a second fit."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the default launcher: an interpreter per rank


def test_fit_validate_test_predict_in_one_process(tmp_path):
    script = Path(__file__).parent / "scripts" / "lifecycle.py"
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["sampler"] == "DistributedSampler"  # each rank got its own half of the data
        assert r["global_step"] == 12
        assert r["n_preds"] == 8  # 16 samples / 2 ranks
        assert len(r["losses"]) == 12
    assert ranks[0]["val"] == ranks[1]["val"] == ranks[0]["test"]  # synced metrics, same data
    assert ranks[0]["losses"] != ranks[1]["losses"]  # different data shards
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]
