"""The files of a sharded checkpoint: one per rank and meta.pt, whatever the model; what they hold, read by the
safetensors library; rows read back at any split of the ranks; a resume on more ranks than saved; and checkpoints of
format version 1 (one DCP file per tensor and rank), which still load."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import hydra
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from helpers.format_1 import SaveFormat1
from helpers.resume_run import resume_fit
from helpers.safetensors_reader import rank_file_tensors
from helpers.tiny_module import TinyModule
from lightning_zoff import ZoffPrecision, ZoffStrategy
from lightning_zoff.checkpoint.consolidate import consolidate
from lightning_zoff.checkpoint.files import CheckpointError
from lightning_zoff.checkpoint.rank_files import RankFiles, Rows, Staging, chunk_start, file_name, write_rank_file

ROOT = Path(__file__).resolve().parents[1]
STEP6 = "epoch=0-step=6.ckpt"


class KeepWhole(pl.Callback):
    """Rank 0 writes the whole fp32 weights the run ends with (gathered by every rank) to `out/whole.pt`."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        whole = trainer.strategy.full_state_dict()  # a collective
        if trainer.is_global_zero:
            torch.save(whole, self.out / "whole.pt")


def test_the_example_gpt_saves_one_file_per_rank_and_meta(tmp_path):
    # the main job's model: conf/model's default (373 files in format version 1: one per tensor and rank)
    module = hydra.utils.instantiate(OmegaConf.load(ROOT / "conf" / "model" / "gpt_tiny.yaml"))
    block, vocab = module.hparams.block_size, module.hparams.vocab_size
    tokens = torch.randint(0, vocab, (4, block + 1), generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZoffStrategy(start_method="fork"), max_steps=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True), KeepWhole(tmp_path)])
    trainer.fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2))
    files = sorted(os.listdir(tmp_path / "ck" / "last.ckpt"))
    assert len(files) <= 2 + 2  # ranks + 2
    assert files == ["meta.pt", "rank0.safetensors", "rank1.safetensors"]
    # what they hold: the fp32 masters of every parameter, split on dim 0 in rank order
    held = rank_file_tensors(tmp_path / "ck" / "last.ckpt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert whole.keys() == module.state_dict().keys()
    for name, tensor in whole.items():
        assert torch.equal(held[f"state_dict/{name}"], tensor), name


def split(tensor: torch.Tensor, world: int, rank: int) -> tuple[int, torch.Tensor]:
    """The first row and the rows of `rank`'s shard, as torch.chunk cuts them (FSDP2's and DTensor's rule)."""
    pieces = torch.chunk(tensor, world) if len(tensor) else ()
    start = sum(len(p) for p in pieces[:rank])
    return start, pieces[rank] if rank < len(pieces) else tensor[len(tensor) :]


def test_rows_read_back_at_any_split_and_dtype(tmp_path):
    # tensors as ranks hold them: rows split on dim 0 (an uneven split: the last rank's rows are fewer, or none),
    # a 0-dim tensor and a buffer held whole by rank 0; written by 3 ranks, read at 1, 2 and 4
    torch.manual_seed(0)
    whole = {"a": torch.randn(7, 5), "b": torch.randn(5).bfloat16(), "c": torch.arange(2 * 3 * 2).view(2, 3, 2),
             "empty": torch.randn(0, 4)}
    held_whole = {"step": torch.tensor(6), "buffer": torch.randn(3, 3)}
    files = []
    for rank in range(3):
        items = {}
        for key, tensor in whole.items():
            start, rows = split(tensor, 3, rank)
            items[key] = Rows(rows.clone(), tuple(tensor.shape), start)
        if rank == 0:
            items |= {key: Rows(t, tuple(t.shape), 0) for key, t in held_whole.items()}
        files.append(tmp_path / file_name(rank))
        write_rank_file(files[-1], items, Staging())
        assert load_file(files[-1]).keys() == items.keys()  # a safetensors file
    reader = RankFiles(files)
    staging = Staging(24)  # a few elements: converted reads go piece by piece
    for world in (1, 2, 4):
        for rank in range(world):
            for key, tensor in whole.items():
                start, want = split(tensor, world, rank)
                assert chunk_start(len(tensor), world, rank) == start
                for dtype in (tensor.dtype, torch.float32, torch.bfloat16):
                    into = torch.full_like(want, -1, dtype=dtype)
                    reader.read_into(key, into, start, staging)
                    assert torch.equal(into, want.to(dtype)), (world, rank, key, dtype)
    for key, tensor in held_whole.items():
        into = torch.zeros_like(tensor)
        reader.read_into(key, into, 0, staging)
        assert torch.equal(into, tensor)


def test_a_resume_on_two_ranks_from_one_rank_reshards(tmp_path):
    one = resume_fit(tmp_path / "one", devices=1, batch_size=8,
                     callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_train_steps=6)])
    assert sorted(os.listdir(tmp_path / "ck" / STEP6)) == ["meta.pt", "rank0.safetensors"]
    two = resume_fit(tmp_path / "two", ckpt_path=tmp_path / "ck" / STEP6)
    # two ranks' batches of 4 are the one rank's batch of 8: their mean loss is its loss
    got = torch.tensor([two[0]["losses"], two[1]["losses"]], dtype=torch.float64).mean(0)
    want = torch.tensor(one[0]["losses"][6:], dtype=torch.float64)
    assert ((got - want).abs() / want).max() < 1e-5


def with_a_frozen_block() -> TinyModule:
    torch.manual_seed(3)
    module = TinyModule()
    module.model.blocks[0].requires_grad_(False)
    return module


@pytest.mark.slow
def test_frozen_parameters_are_saved_as_the_model_holds_them_and_resume(tmp_path):
    bf16 = lambda: [ZoffPrecision("bf16-mixed")]  # noqa: E731
    every6 = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_train_steps=6)
    full = resume_fit(tmp_path / "full", module=with_a_frozen_block(), plugins=bf16(), callbacks=[every6])
    resumed = resume_fit(tmp_path / "resumed", module=with_a_frozen_block(), plugins=bf16(),
                         ckpt_path=tmp_path / "ck" / STEP6)
    for rank in (0, 1):
        assert resumed[rank]["losses"] == full[rank]["losses"][6:]
    held = rank_file_tensors(tmp_path / "ck" / STEP6)
    consolidate(tmp_path / "ck" / STEP6, tmp_path / "one.pt", progress=False)
    one = torch.load(tmp_path / "one.pt", weights_only=True)["state_dict"]
    initial = with_a_frozen_block().state_dict()
    for name, tensor in initial.items():
        saved = held[f"state_dict/{name}"]
        assert one[name].dtype == torch.float32
        if name.startswith("model.blocks.0."):  # frozen: its 16-bit value, never trained, in 16 bits and whole
            assert saved.dtype == torch.bfloat16, name
            assert torch.equal(saved, tensor.bfloat16()), name
            assert torch.equal(one[name], saved.float()), name
        else:  # trained: the fp32 master
            assert saved.dtype == torch.float32, name
            assert torch.equal(one[name], saved), name


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """12 steps on 2 ranks, uninterrupted, checkpointing at step 6 in both formats."""
    out = tmp_path_factory.mktemp("uninterrupted")
    every6 = ModelCheckpoint(dirpath=out / "ck", save_top_k=-1, every_n_train_steps=6)
    return out, resume_fit(out / "run", callbacks=[every6, SaveFormat1(6, out / "v1")])


def test_format_1_is_one_dcp_file_per_tensor_and_rank(run):
    files = os.listdir(run[0] / "v1" / STEP6)
    assert len([f for f in files if f.endswith(".distcp")]) > 100
    assert {"meta.pt", ".metadata"} <= set(files)


@pytest.mark.parametrize("devices", [2, 1])
def test_format_1_resumes(run, tmp_path, devices):
    _, full = run
    resumed = resume_fit(tmp_path, devices=devices, batch_size=8 // devices, ckpt_path=run[0] / "v1" / STEP6)
    if devices == 2:  # bit for bit
        for rank in (0, 1):
            assert resumed[rank]["losses"] == full[rank]["losses"][6:]
        return
    reference = torch.tensor([full[0]["losses"][6:], full[1]["losses"][6:]], dtype=torch.float64).mean(0)
    got = torch.tensor(resumed[0]["losses"], dtype=torch.float64)
    assert ((got - reference).abs() / reference).max() < 1e-5


def test_format_1_consolidates_to_the_same_weights(run, tmp_path):
    consolidate(run[0] / "v1" / STEP6, tmp_path / "v1.pt", progress=False)
    consolidate(run[0] / "ck" / STEP6, tmp_path / "v2.pt", progress=False)
    v1, v2 = (torch.load(tmp_path / f"{v}.pt", weights_only=True)["state_dict"] for v in ("v1", "v2"))
    assert v1.keys() == v2.keys()
    assert all(torch.equal(v1[k], v2[k]) for k in v1)


def test_format_1_refuses_a_truncated_file(run, tmp_path):
    ckpt = tmp_path / "copy.ckpt"
    shutil.copytree(run[0] / "v1" / STEP6, ckpt)
    (ckpt / "__1_0.distcp").write_bytes((ckpt / "__1_0.distcp").read_bytes()[:10])
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: truncated: 10 bytes, the checkpoint's index needs \d+"):
        consolidate(ckpt, tmp_path / "model.pt", progress=False)
