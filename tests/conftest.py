import logging
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(session, config, items):
    # GNU OpenMP cannot fork once its thread pool has started: a forked child that opens a parallel region then
    # waits forever. The kernel tests start our pool (2 threads) in this process, and most Lightning tests fork
    # their ranks from it, so the kernel tests run last.
    items.sort(key=lambda item: Path(str(item.fspath)).name == "test_kernels.py")


@pytest.fixture
def said(tmp_path):
    """zoff's lines as a rank logged them (`helpers.simulated_accelerator.Said`): a forked rank's go through a file."""
    from helpers.simulated_accelerator import Said

    handler = logging.FileHandler(tmp_path / "said.log")
    logger = logging.getLogger("lightning_zoff")
    logger.addHandler(handler)
    yield Said(tmp_path / "said.log")
    logger.removeHandler(handler)
    handler.close()
