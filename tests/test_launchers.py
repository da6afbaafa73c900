"""What the main process gets back from forked ranks: the trained weights only when asked, and when the OS kills a
rank, a message that says so and how much memory the rank had used."""

from __future__ import annotations

import os
import re
import signal
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.multiprocessing import ProcessExitedException

from helpers.tiny import token_loader
from helpers.tiny_module import TinyModule
from lightning_zoff import ZoffStrategy
from lightning_zoff.checkpoint.consolidate import consolidate


def trainer(tmp_path, strategy, **kwargs):
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, **kwargs)


@pytest.fixture
def gathers(monkeypatch, tmp_path):
    """Counts the gathers of the whole model in the ranks (the patch is forked along with this process)."""
    marker = tmp_path / "gathered"
    full_state_dict = ZoffStrategy.full_state_dict

    def counted(self):
        with open(marker, "a") as f:
            f.write(f"{self.global_rank}\n")
        return full_state_dict(self)

    monkeypatch.setattr(ZoffStrategy, "full_state_dict", counted)
    return lambda: sorted(marker.read_text().split()) if marker.exists() else []


def test_the_main_process_gets_no_weights_unless_asked(tmp_path, gathers):
    pl.seed_everything(3)
    module = TinyModule()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True, save_top_k=0)
    fit = trainer(tmp_path, ZoffStrategy(start_method="fork"), callbacks=[checkpoints])
    fit.fit(module, token_loader(n=32))
    assert fit.state.finished
    assert gathers() == []  # no rank gathered the model
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # the pre-fit weights, untouched

    # evaluating those would be silently wrong: refused before any rank starts, with what to do instead
    fit_ranks = list(fit.strategy.launcher.procs)
    with pytest.raises(RuntimeError, match=r"TinyModule was trained by an earlier fit whose ranks kept the trained"
                                           r" weights.*`test\(\.\.\., ckpt_path=\.\.\.\)`"
                                           r".*weights_to_main_process=True"):
        fit.test(module, token_loader(n=8))
    assert fit.strategy.launcher.procs == fit_ranks  # none started
    last = tmp_path / "ck" / "last.ckpt"
    from_checkpoint = fit.test(module, token_loader(n=8), ckpt_path=last, verbose=False)[0]["test_loss"]

    # the same weights loaded by hand (consolidated from the checkpoint) make the module current again
    consolidate(last, tmp_path / "last.pt", progress=False)
    module.load_state_dict(torch.load(tmp_path / "last.pt", weights_only=True)["state_dict"])
    loaded = trainer(tmp_path, ZoffStrategy(start_method="fork")).test(module, token_loader(n=8), verbose=False)
    assert loaded[0]["test_loss"] == pytest.approx(from_checkpoint, rel=1e-6)
    assert from_checkpoint < trainer(tmp_path, ZoffStrategy(start_method="fork")).test(
        TinyModule(), token_loader(n=8), verbose=False)[0]["test_loss"]  # trained: better than a fresh init


def test_the_main_process_gets_the_weights_when_asked(tmp_path, gathers):
    pl.seed_everything(3)
    module = TinyModule()
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True, save_top_k=0)
    fit = trainer(tmp_path, ZoffStrategy(start_method="fork", weights_to_main_process=True), callbacks=[checkpoints])
    fit.fit(module, token_loader(n=32))
    assert gathers() == ["0", "1"]  # every rank took part in the gather
    consolidate(tmp_path / "ck" / "last.ckpt", tmp_path / "last.pt", progress=False)
    saved = torch.load(tmp_path / "last.pt", weights_only=True)["state_dict"]  # the same step, by another route
    assert module.state_dict().keys() == saved.keys()
    assert all(torch.equal(v, saved[k]) for k, v in module.state_dict().items())
    fit.test(module, token_loader(n=8), verbose=False)  # current: no checkpoint needed


class KilledAtStep2(TinyModule):
    """Rank 1 takes about 200 MB more memory in its first step and is killed (SIGKILL, as the OOM killer does) in its
    second, after noting its own peak resident memory."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 0:
            self.ballast = torch.ones(50 * 2**20)  # 200 MB, written: resident
        if self.global_rank == 1 and batch_idx == 1:
            time.sleep(0.5)  # the main process reads every 0.1 s
            with open("/proc/self/status") as status:
                peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
            (self.out / "peak_kb").write_text(str(peak))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


def test_a_killed_rank_is_reported_as_out_of_memory_with_its_peak(tmp_path):
    with pytest.raises(ProcessExitedException) as info:
        trainer(tmp_path, ZoffStrategy(start_method="fork"), enable_checkpointing=False).fit(
            KilledAtStep2(tmp_path), token_loader(n=32))
    message = str(info.value)
    assert re.match(r"rank 1 \(pid \d+\) was killed by SIGKILL: most likely the host ran out of memory", message)
    assert "overlap=False" in message  # what to do
    reported = int(re.search(r"rank 1 ([\d,]+) MB", message)[1].replace(",", ""))
    own = int((tmp_path / "peak_kb").read_text()) / 1024
    assert own > 200, (reported, own)
    assert abs(reported - own) <= 0.02 * own, (reported, own)
    assert re.search(r"rank 0 [\d,]+ MB", message)


def test_the_first_failing_rank_of_a_node_claims_the_message(tmp_path, monkeypatch):
    import subprocess
    import sys
    import tempfile

    from lightning_zoff.launch import rank_errors

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv(rank_errors.ENV, "")  # restored (unset) after the test: prepare_node sets it
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"zoff-node-errors-{ended.stdout.strip()}-a"
    running = tmp_path / f"zoff-node-errors-{os.getpid()}-b"
    stale.mkdir()
    running.mkdir()
    rank_errors.prepare_node()
    assert not stale.exists()  # left by a run whose main process has ended
    assert running.exists()
    board = tmp_path / os.environ[rank_errors.ENV]
    assert board.is_dir()
    assert board.name.startswith(f"zoff-node-errors-{os.getpid()}-")
    assert rank_errors._claim(board, 1)
    assert (board / "first").read_text() == "1"
    assert not rank_errors._claim(board, 0)  # rank 1 was first: rank 0 stays quiet
    assert rank_errors._claim(tmp_path / "gone", 0)  # no board (its run ended well): nobody else speaks


@pytest.mark.parametrize("ranks", ["forked", "started_outside"])
def test_a_missing_ckpt_path_is_refused_before_any_rank_sets_up(tmp_path, monkeypatch, ranks):
    """Forked ranks, and ranks started outside the launcher (torchrun, SLURM, or this process as rank 0 after an
    earlier fit of Lightning's default launcher, which leaves LOCAL_RANK set): refused before any process group, with
    a relative path."""
    if ranks == "started_outside":
        for key, value in {"LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": "29533"}.items():
            monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)

    def no_rank(*args, **kwargs):
        raise AssertionError("a rank started")

    monkeypatch.setattr(torch.distributed, "init_process_group", no_rank)
    fit = pl.Trainer(accelerator="cpu", devices=2 if ranks == "forked" else 1, max_steps=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     strategy=ZoffStrategy(start_method="fork" if ranks == "forked" else "subprocess"))
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"^missing\.ckpt: no such checkpoint"):
        fit.fit(TinyModule(), token_loader(n=8), ckpt_path="missing.ckpt")
    assert time.perf_counter() - start < 1
