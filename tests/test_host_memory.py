"""The host's memory under the process tree users run: DataLoader workers (forks of each rank) inherit none of zoff's
host buffers and train the same batches, the host plan keeps room for them, and a host that runs short stops the run
in one line at a step, leaving the last checkpoint whole."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import psutil
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import helpers.trainer
from helpers.tiny import token_loader
from helpers.tiny_module import TinyModule, read_probe
from lightning_zoff import ZoffStrategy
from lightning_zoff.checkpoint.consolidate import consolidate
from lightning_zoff.host_watch import HostMemoryLow
from lightning_zoff.placement.host_buffers import mapped_ranges
from lightning_zoff.placement.machine import LOADER_WORKER_BYTES


def loader(workers: int) -> DataLoader:
    data = token_loader(batch_size=4).dataset
    return DataLoader(data, batch_size=4, num_workers=workers, persistent_workers=workers > 0)


def mapped_by(pid: int | str) -> list[tuple[int, int]]:
    ranges = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        start, end = line.split()[0].split("-")
        ranges.append((int(start, 16), int(end, 16)))
    return ranges


def not_forked() -> list[tuple[int, int]]:
    """This process's mappings the kernel leaves out of a fork (smaps' VmFlags `dc`)."""
    ranges, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split()[0] and not line.startswith("VmFlags"):
            start, end = line.split()[0].split("-")
            current = (int(start, 16), int(end, 16))
        elif line.startswith("VmFlags:") and " dc" in line and current is not None:
            ranges.append(current)
    return ranges


def within(inner: list[tuple[int, int]], outer: list[tuple[int, int]]) -> bool:
    return all(any(s <= a and b <= e for s, e in outer) for a, b in inner)


class WorkersMaps(pl.Callback):
    """At the third batch, once the state is built and the workers run: which of zoff's buffers a worker maps."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != 2:
            return
        ours = mapped_ranges()
        workers = psutil.Process().children(recursive=True)
        # a worker may map memory of its own where a buffer of the rank lies (the range is free in the worker): what
        # the worker would have inherited is the buffer's range itself
        inherited = [(s, e) for w in workers for s, e in mapped_by(w.pid) if (s, e) in ours]
        report = {"workers": len(workers), "buffers": len(ours), "buffer_bytes": sum(b - a for a, b in ours),
                  "inherited": len(inherited), "kept_from_forks": within(ours, not_forked()),
                  "planned": trainer.strategy.memory_report["host_total"]}
        (self.out / f"maps{trainer.global_rank}.json").write_text(json.dumps(report))


def fit(out: Path, workers: int, **options) -> None:
    pl.seed_everything(7)
    helpers.trainer.fit(TinyModule(), loader(workers), ZoffStrategy(start_method="fork", **options), out=out,
                        max_steps=6, clip=0.84, callbacks=[WorkersMaps(out)])


@pytest.mark.slow
def test_workers_map_none_of_zoffs_buffers_and_train_the_same(tmp_path):
    fit(tmp_path / "none", 0)
    fit(tmp_path / "two", 2)
    for rank in (0, 1):
        maps = json.loads((tmp_path / "two" / f"maps{rank}.json").read_text())
        assert maps["workers"] == 2
        assert maps["buffers"] > 0
        assert maps["buffer_bytes"] >= maps["planned"] > 0  # every planned byte is in a mapping of zoff's
        assert maps["inherited"] == 0, maps
        assert maps["kept_from_forks"], maps
        assert read_probe(tmp_path / "two", rank)["losses"] == read_probe(tmp_path / "none", rank)["losses"]
    without, counted = read_probe(tmp_path / "none")["memory"], read_probe(tmp_path / "two")["memory"]
    assert (without["loader_workers"], counted["loader_workers"]) == (0, 2)
    assert counted["host_kept"] >= 2 * LOADER_WORKER_BYTES  # the plan keeps the workers' room


def test_a_fork_of_the_rank_maps_none_of_its_buffers():
    from lightning_zoff.placement.host_buffers import host_empty

    state = [host_empty(1 << 20, torch.float32, torch.device("cpu"), pin=False).fill_(1.0) for _ in range(3)]
    ours = mapped_ranges()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # touches nothing: waits to be told to exit
        os.close(write)
        os.read(read, 1)
        os._exit(0)
    try:
        theirs = mapped_by(child)
    finally:
        os.write(write, b"x")
        os.waitpid(child, 0)
    assert len(ours) >= 3
    assert all(t.sum().item() == 1 << 20 for t in state)
    assert within(ours, not_forked())
    # the child ran nothing after the fork, so nothing of its own lies where the buffers lie
    assert not [(s, e) for s, e in theirs for a, b in ours if s < b and a < e]


HOST_GB = 20.0  # what the host has available as the ranks read it: the machine's own reading varies with its load


class EatHost(pl.Callback):
    """Rank 0 takes `nbytes` of host memory (written, so it is resident) before step `at`'s batch; the host's reading
    falls by as much."""

    def __init__(self, at: int, nbytes: int) -> None:
        self.at, self.nbytes, self.held = at, nbytes, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at and trainer.global_rank == 0 and self.held is None:
            self.held = torch.ones(self.nbytes // 4)
            EatHost.eaten = self.nbytes

    eaten = 0


def test_a_host_that_runs_short_stops_the_run_in_one_line_with_the_checkpoint_whole(tmp_path, monkeypatch):
    # the ranks (forks of this process) read HOST_GB less what the test took: 20 GB until step 3, 18.5 GB after it,
    # under the floor of 19 GB; a reading of the machine's own would follow every other process on it
    monkeypatch.setattr("lightning_zoff.placement.rank.available_bytes", lambda: int(HOST_GB * 1e9) - EatHost.eaten)
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    pl.seed_everything(7)
    with pytest.raises(HostMemoryLow) as err:
        helpers.trainer.fit(TinyModule(), loader(0), ZoffStrategy(start_method="fork", host_memory_floor=19.0),
                            out=tmp_path, max_steps=8, callbacks=[EatHost(3, int(1.5e9)), saves],
                            enable_checkpointing=True)
    lines = [line for line in str(err.value).splitlines() if "zoff: stopped the run" in line]
    assert len(lines) == 1, str(err.value)[-2000:]
    assert "at step 3: the host has 18.5 GB available, under the floor of 19.0 GB" in lines[0]
    assert "host_memory_floor" in lines[0]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [f"epoch=0-step={s}.ckpt" for s in (1, 2, 3)]
    consolidate(tmp_path / "ckpt" / "epoch=0-step=3.ckpt", tmp_path / "whole.pt", progress=False)
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert whole["state_dict"]
    assert all(torch.isfinite(t).all() for t in whole["state_dict"].values())


@pytest.mark.parametrize(("given", "workers"), [("loader", 3), ("datamodule", 2), ("hparams", 5), ("hook", 0)])
def test_the_plan_counts_the_workers_fit_was_given(given, workers):
    from lightning_zoff.examples.corpus import CorpusDataModule
    from lightning_zoff.trainer.loaders import loader_workers

    class Hyper(TinyModule):
        def __init__(self, num_workers: int) -> None:
            super().__init__()
            self.save_hyperparameters()

        def train_dataloader(self):
            return loader(0)

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    module, data = TinyModule(), {}
    if given == "loader":
        data = {"train_dataloaders": DataLoader(token_loader().dataset, num_workers=3)}
    elif given == "datamodule":
        data = {"datamodule": CorpusDataModule(num_workers=2)}
    elif given == "hparams":
        module = Hyper(num_workers=5)
    trainer._data_connector.attach_data(module, **data)  # what trainer.fit does before the strategy's setup
    assert loader_workers(trainer, None) == workers
    assert loader_workers(trainer, 7) == 7  # the option wins
