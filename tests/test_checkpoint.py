"""Checkpoints: sharded save and resume at the same or another world size, one-file export and consolidation, crash
safety, and clear refusals. The reference is always the same run, uninterrupted."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.multiprocessing import ProcessRaisedException

from helpers.resume_run import SaveBatch, resume_fit
from helpers.safetensors_reader import nested, rank_file_tensors
from helpers.tiny import TinyLM, token_loader
from helpers.tiny_module import TinyModule, read_probe
from lightning_zoff import ZoffPrecision, ZoffStatsMonitor, ZoffStrategy
from lightning_zoff.checkpoint import full_optimizer_state
from lightning_zoff.checkpoint.consolidate import consolidate
from lightning_zoff.checkpoint.files import CheckpointError, recover

REPO = Path(__file__).parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
STEP6 = "epoch=0-step=6.ckpt"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """12 steps on 2 ranks, uninterrupted, checkpointing every 6 steps (all kept) and every 3 (latest and last)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    every6 = ModelCheckpoint(dirpath=out / "ck", save_top_k=-1, every_n_train_steps=6)
    latest = ModelCheckpoint(dirpath=out / "top", save_top_k=1, save_last=True, every_n_train_steps=3)
    return out, resume_fit(out / "run", callbacks=[every6, latest, SaveBatch(6, out)])


@pytest.fixture(scope="module")
def run_bf16(tmp_path_factory):
    """The same 12 steps with bf16 moments, checkpointing every 6 steps."""
    out = tmp_path_factory.mktemp("uninterrupted_bf16")
    every6 = ModelCheckpoint(dirpath=out / "ck", save_top_k=-1, every_n_train_steps=6)
    return out, resume_fit(out / "run", optimizer_state_dtype="bf16", callbacks=[every6])


RUN_OF = {"fp32": "run", "bf16": "run_bf16"}  # the uninterrupted run (fixture) by optimizer_state_dtype
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_resume_on_two_ranks_is_bit_exact(request, tmp_path, moments):
    out, full = request.getfixturevalue(RUN_OF[moments])
    resumed = resume_fit(tmp_path, ckpt_path=out / "ck" / STEP6, optimizer_state_dtype=moments)
    for rank in (0, 1):
        assert len(full[rank]["losses"]) == 12
        assert len(resumed[rank]["losses"]) == 6
        assert resumed[rank]["losses"] == full[rank]["losses"][6:]
        assert resumed[rank]["lr"] == full[rank]["lr"]  # StepLR's position and the groups' lr came back


def test_resume_with_the_gpu_share_of_the_updates_is_bit_exact(run, tmp_path):
    # the accelerator's share of the host's updates computes the host kernels' bits: a run that lends half of them
    # resumes the uninterrupted host run exactly, and a checkpoint it saves resumes exactly without the share
    out, full = run
    lent = resume_fit(tmp_path / "lent", ckpt_path=out / "ck" / STEP6, accelerator_update_share=0.5,
                      callbacks=[ZoffStatsMonitor()])
    assert lent[0]["telemetry"]["zoff/lent_units"] > 0
    saved = tmp_path / "saved"
    resume_fit(saved, max_steps=6, accelerator_update_share=0.5,
               callbacks=[ModelCheckpoint(dirpath=saved / "ck", save_top_k=-1, every_n_train_steps=6)])
    back = resume_fit(tmp_path / "back", ckpt_path=saved / "ck" / STEP6, accelerator_update_share="none")
    for rank in (0, 1):
        assert lent[rank]["losses"] == full[rank]["losses"][6:]
        assert back[rank]["losses"] == full[rank]["losses"][6:]


class MomentsAtStart(pl.Callback):
    """Rank 0 writes the whole moments the run starts from (restored from the checkpoint) to `out/moments.pt`."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.engine.wait_idle()
        state = full_optimizer_state(pl_module, trainer.strategy.engine, trainer.optimizers[0])["state"]  # collective
        if trainer.is_global_zero:
            torch.save(state, self.out / "moments.pt")


@pytest.mark.parametrize(("saved", "loaded"), [("fp32", "bf16"), ("bf16", "fp32")])
def test_moments_load_into_a_run_of_the_other_dtype(request, tmp_path, saved, loaded):
    out, full = request.getfixturevalue(RUN_OF[saved])
    ckpt = out / "ck" / STEP6
    resumed = resume_fit(tmp_path / "run", ckpt_path=ckpt, optimizer_state_dtype=loaded, max_steps=8,
                         callbacks=[MomentsAtStart(tmp_path)])
    written = nested(rank_file_tensors(ckpt), "optimizer_0/")
    restored = torch.load(tmp_path / "moments.pt", weights_only=True)
    assert restored.keys() == written.keys()
    for name, moments in written.items():
        assert int(restored[name]["step"]) == int(moments["step"]) == 6
        for key in ("exp_avg", "exp_avg_sq"):
            assert moments[key].dtype == DTYPES[saved]  # saved in the run's own dtype
            # converted: rounded to the nearest bf16, or exactly to fp32
            assert torch.equal(restored[name][key], moments[key].to(DTYPES[loaded])), (name, key)
    for rank in (0, 1):  # same weights, so the same first loss; then the moments' precision differs a little
        assert resumed[rank]["losses"][0] == full[rank]["losses"][6]
        assert resumed[rank]["losses"] == pytest.approx(full[rank]["losses"][6:8], rel=1e-4)


@pytest.mark.slow
def test_a_checkpoint_resumes_with_another_placement_of_the_state(run, tmp_path):
    """One layout whatever the placement: the host run's checkpoint resumes with every unit's state on the
    "accelerator" (torch ops on CPU tensors here) and from the same moments; a checkpoint saved with half the state
    there resumes on the host."""
    out, full = run
    on_host, on_accel = tmp_path / "host", tmp_path / "accel"
    resume_fit(on_host, ckpt_path=out / "ck" / STEP6, max_steps=7, callbacks=[MomentsAtStart(on_host)])
    moved = resume_fit(on_accel, ckpt_path=out / "ck" / STEP6, accelerator_state=1.0,
                       callbacks=[MomentsAtStart(on_accel)])
    host_moments, accel_moments = torch.load(on_host / "moments.pt"), torch.load(on_accel / "moments.pt")
    assert host_moments.keys() == accel_moments.keys()
    for name, state in host_moments.items():
        for key, value in state.items():
            assert torch.equal(accel_moments[name][key], value), (name, key)
    for rank in (0, 1):
        assert set(moved[rank]["placements"].values()) == {"accelerator"}
        got, want = torch.tensor(moved[rank]["losses"]), torch.tensor(full[rank]["losses"][6:])
        assert ((got - want).abs() / want.abs()).max() < 1e-5
    # and back: saved with half the units' state on the "accelerator", resumed with all of it on the host
    half = tmp_path / "half"
    resume_fit(half, max_steps=6, accelerator_state=0.5,
               callbacks=[ModelCheckpoint(dirpath=half / "ck", save_top_k=-1, every_n_train_steps=6)])
    back = resume_fit(tmp_path / "back", ckpt_path=half / "ck" / STEP6, accelerator_state="none")
    for rank in (0, 1):
        assert set(back[rank]["placements"].values()) == {"host"}
        got, want = torch.tensor(back[rank]["losses"]), torch.tensor(full[rank]["losses"][6:])
        assert ((got - want).abs() / want.abs()).max() < 1e-5


def test_resume_on_one_rank_reshards(run, tmp_path):
    out, full = run
    resumed = resume_fit(tmp_path, devices=1, batch_size=8, ckpt_path=out / "ck" / STEP6)
    # one rank's batch of 8 holds both ranks' batches of 4: its loss is their mean
    reference = torch.tensor([full[0]["losses"][6:], full[1]["losses"][6:]], dtype=torch.float64).mean(0)
    got = torch.tensor(resumed[0]["losses"], dtype=torch.float64)
    assert ((got - reference).abs() / reference).max() < 1e-5


def test_top_k_and_last_keep_whole_directories(run):
    out, _ = run
    top = out / "top"
    assert sorted(os.listdir(top)) == ["epoch=1-step=12.ckpt", "last.ckpt"]  # steps 3, 6, 9 were removed
    for name in os.listdir(top):
        assert (top / name / "meta.pt").is_file()
        assert torch.load(top / name / "meta.pt", weights_only=False)["global_step"] == 12


@pytest.fixture(scope="module")
def consolidated(run, tmp_path_factory):
    """The step-6 checkpoint through `python -m lightning_zoff.consolidate`: its weights."""
    out = tmp_path_factory.mktemp("consolidated") / "model.pt"
    # --buffer-mb 0: one tensor per read, so the batching and the placement of every tensor in the file are exercised
    cmd = [sys.executable, "-m", "lightning_zoff.consolidate", str(run[0] / "ck" / STEP6), str(out), "--buffer-mb", "0",
           "--no-progress"]
    result = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return torch.load(out, weights_only=True)


def first_loss(state_dict: dict, batch_file: Path) -> float:
    model = TinyModule()
    model.load_state_dict(state_dict, strict=True)
    x, y = torch.load(batch_file)
    with torch.no_grad():
        return F.cross_entropy(model.model(x).float().flatten(0, 1), y.flatten()).item()


@pytest.mark.slow
def test_consolidated_file_loads_into_the_plain_model(run, consolidated):
    out, full = run
    state = consolidated["state_dict"]
    assert state.keys() == TinyModule().state_dict().keys()
    assert {t.dtype for t in state.values()} == {torch.float32}
    for rank in (0, 1):  # the loss each rank saw at step 6, from the weights of step 6
        assert first_loss(state, out / f"batch{rank}.pt") == pytest.approx(full[rank]["losses"][6], rel=1e-6)


def test_test_from_a_checkpoint_evaluates_its_weights(run, consolidated):
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZoffStrategy(start_method="fork"), logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    loader = token_loader(n=16, seed=1)
    test_loss = trainer.test(TinyModule(), loader, ckpt_path=run[0] / "ck" / STEP6)[0]["test_loss"]
    model = TinyModule()
    model.load_state_dict(consolidated["state_dict"])
    x, y = loader.dataset.tensors
    with torch.no_grad():
        expected = F.cross_entropy(model.model(x).flatten(0, 1), y.flatten()).item()
    assert test_loss == pytest.approx(expected, rel=1e-5)


# loads a file with torch alone: lightning_zoff cannot be imported
PLAIN_LOAD = """
import sys, torch
sys.modules["lightning_zoff"] = None
torch.save(torch.load(sys.argv[1], weights_only=True)["state_dict"], sys.argv[2])
"""


@pytest.mark.slow
def test_full_file_loads_without_zoff_and_resumes(run, consolidated, tmp_path):
    _, full = run
    resume_fit(tmp_path / "run", max_steps=6, state_dict_type="full",
               callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=6)])
    file = tmp_path / "ck" / STEP6
    assert file.is_file()
    subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(file), str(tmp_path / "sd.pt")], check=True, timeout=60)
    plain = torch.load(tmp_path / "sd.pt", weights_only=True)
    for name, tensor in consolidated["state_dict"].items():  # the same training written two ways
        assert torch.equal(plain[name], tensor), name
    loaded = TinyModule.load_from_checkpoint(file, weights_only=False)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in plain.items())
    resumed = resume_fit(tmp_path / "resumed", ckpt_path=file, state_dict_type="full")
    for rank in (0, 1):
        assert resumed[rank]["losses"] == full[rank]["losses"][6:]


@pytest.mark.slow
def test_fp16_loss_scale_and_lr_schedule_survive(tmp_path):
    def fp16():  # grows the scale every 2 good steps, so a reset scaler would show
        return [ZoffPrecision("16-mixed", scale=2.0**8, growth_interval=2)]

    full = resume_fit(tmp_path / "full", plugins=fp16(), callbacks=[
        ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_train_steps=6), ZoffStatsMonitor()])
    resumed = resume_fit(tmp_path / "resumed", plugins=fp16(), ckpt_path=tmp_path / "ck" / STEP6,
                         callbacks=[ZoffStatsMonitor()])
    for rank in (0, 1):
        assert resumed[rank]["param_dtypes"] == ["torch.float16"]
        assert resumed[rank]["losses"] == full[rank]["losses"][6:]
        assert resumed[rank]["telemetry"]["zoff/loss_scale"] == full[rank]["telemetry"]["zoff/loss_scale"] == 2.0**14
        assert resumed[rank]["lr"] == full[rank]["lr"] == [3e-3 * 0.5**4, 6e-3 * 0.5**4]


@pytest.mark.slow
def test_sigkill_during_a_save_leaves_the_previous_checkpoint(run, tmp_path):
    _, full = run
    script = Path(__file__).parent / "scripts" / "killed_save.py"
    killed = subprocess.run([sys.executable, str(script), str(tmp_path)], env=ENV, start_new_session=True,
                            capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    last = tmp_path / "ck" / "last.ckpt"
    assert (tmp_path / "ck" / ".last.ckpt.zoff-partial").is_dir()  # the save it died in
    assert torch.load(last / "meta.pt", weights_only=False)["global_step"] == 6  # the one before, whole
    resumed = resume_fit(tmp_path / "resumed", ckpt_path=last)
    for rank in (0, 1):
        assert resumed[rank]["losses"] == full[rank]["losses"][6:]


class TwoBlocks(TinyModule):
    def __init__(self):
        super().__init__()
        self.model = TinyLM(n_blocks=2)


def truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def other_version(ckpt: Path) -> Path:
    meta = torch.load(ckpt / "meta.pt", weights_only=False)
    meta["zoff"]["format_version"] = 99
    torch.save(meta, ckpt / "meta.pt")
    return ckpt / "meta.pt"


@pytest.mark.parametrize(("damage", "module", "problem"), [
    (lambda c: truncate(c / "rank1.safetensors"), TinyModule,
     r"rank1\.safetensors: truncated: \d+ bytes, meta\.pt records \d+"),
    (lambda c: (c / "rank0.safetensors").unlink() or c / "rank0.safetensors", TinyModule,
     r"rank0\.safetensors: missing; meta\.pt names it"),
    (lambda c: truncate(c / "meta.pt"), TinyModule, r"meta\.pt: truncated: its \d+ bytes end inside the zip archive"),
    (lambda c: (c / "meta.pt").unlink() or c, TinyModule, r"ckpt: no meta\.pt, which a zoff checkpoint writes last"),
    (other_version, TinyModule, r"meta\.pt: checkpoint format version 99; this lightning_zoff reads versions 1 and 2"),
    (lambda c: c, TwoBlocks,
     r"meta\.pt: written for another model: missing \[\], unexpected \['model\.blocks\.2\.fc1\.bias'"),
], ids=["truncated_shard", "missing_shard", "truncated_meta", "unfinished", "other_version", "other_model"])
def test_damaged_or_foreign_checkpoints_are_refused(run, tmp_path, damage, module, problem):
    ckpt = tmp_path / "copy.ckpt"
    shutil.copytree(run[0] / "ck" / STEP6, ckpt)
    named = damage(ckpt)
    with pytest.raises((CheckpointError, ProcessRaisedException)) as err:
        resume_fit(tmp_path / "run", devices=1, batch_size=8, module=module(), ckpt_path=ckpt)
    message = str(err.value)
    assert isinstance(err.value, CheckpointError) or "CheckpointError" in message
    assert str(named) in message
    assert re.search(problem, message)  # names the file and what is wrong with it

def test_consolidate_refuses_a_truncated_checkpoint(run, tmp_path):
    ckpt = tmp_path / "copy.ckpt"
    shutil.copytree(run[0] / "ck" / STEP6, ckpt)
    truncate(ckpt / "rank0.safetensors")
    with pytest.raises(CheckpointError, match=r"copy\.ckpt/rank0\.safetensors: truncated"):
        consolidate(ckpt, tmp_path / "model.pt", progress=False)
    assert not (tmp_path / "model.pt").exists()


def test_a_replacement_cut_between_its_renames_is_recovered(tmp_path):
    path = tmp_path / "last.ckpt"
    (tmp_path / ".last.ckpt.zoff-previous").mkdir()  # the old checkpoint, moved aside; the new one never arrived
    recover(path)
    assert path.is_dir()
    assert not (tmp_path / ".last.ckpt.zoff-previous").exists()
    (tmp_path / ".last.ckpt.zoff-previous").mkdir()  # both there: the new one arrived, drop the old
    recover(path)
    assert path.is_dir()
    assert not (tmp_path / ".last.ckpt.zoff-previous").exists()


def _two_nodes(out: Path, *ckpt: Path) -> dict:
    """Two processes started as two nodes of one process each would be by a cluster: node rank, master address
    and port in the environment, nothing else shared. Returns what each global rank saw."""
    script = Path(__file__).parent / "scripts" / "multinode.py"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node)}
        env.pop("LOCAL_RANK", None)
        procs.append(subprocess.Popen([sys.executable, str(script), str(out), *map(str, ckpt)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output[-3000:]
    return {rank: read_probe(out / "run", rank) for rank in (0, 1)}


@pytest.mark.slow
def test_two_nodes_train_and_resume_like_one_node(run, tmp_path):
    # the same global batch over 2 nodes x 1 process as over 1 node x 2 processes: the same bits
    _, full = run
    nodes = _two_nodes(tmp_path / "nodes")
    for rank in (0, 1):
        assert nodes[rank]["world_size"] == 2
        assert nodes[rank]["losses"] == full[rank]["losses"]
    resumed = _two_nodes(tmp_path / "resumed", tmp_path / "nodes" / "ck" / STEP6)
    for rank in (0, 1):
        assert resumed[rank]["losses"] == full[rank]["losses"][6:]
