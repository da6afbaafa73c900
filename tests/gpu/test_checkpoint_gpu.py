"""Checkpoints of optimizer state that lives on the GPU: written from where it lives through a bounded host buffer,
loaded back in place, and a resume from them continues the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from lightning_zoff.checkpoint.rank_files import RankFiles, Rows, Staging, write_rank_file
from zoffbench.harness import call

ROOT = Path(__file__).resolve().parents[2]


def test_rank_files_write_and_read_gpu_tensors(tmp_path):
    torch.manual_seed(0)
    whole = {"a": torch.randn(300, 7, device="cuda"), "b": torch.randn(1000, device="cuda").bfloat16()}
    file = tmp_path / "rank0.safetensors"
    write_rank_file(file, {k: Rows(t, tuple(t.shape), 0) for k, t in whole.items()}, Staging(256))
    on_disk = load_file(file)
    assert all(torch.equal(on_disk[k], t.cpu()) for k, t in whole.items())
    reader = RankFiles([file])
    for device in ("cuda", "cpu"):
        for key, tensor in whole.items():
            for dtype in (tensor.dtype, torch.float32):
                into = torch.zeros_like(tensor, dtype=dtype, device=device)
                reader.read_into(key, into, 0, Staging(256))
                assert torch.equal(into.cpu(), tensor.to(dtype).cpu()), (device, key, dtype)


def fit_and_resume(out: str, accelerator_state: float | str) -> dict:
    """6 steps uninterrupted (2 epochs of 3) with a checkpoint at step 3, the end of the first epoch, then a resume
    from it to step 6."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zoff import ZoffStrategy
    from lightning_zoff.examples.corpus import SyntheticDataModule
    from lightning_zoff.examples.gpt import GPTModule

    class Losses(pl.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(outputs["loss"].item())

    def fit(ckpt_path=None, callbacks=()):
        pl.seed_everything(0)
        losses = Losses()
        trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=ZoffStrategy(accelerator_state=accelerator_state),
                             precision="bf16-mixed", max_steps=6, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, callbacks=[losses, *callbacks])
        module = GPTModule(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64)
        trainer.fit(module, datamodule=SyntheticDataModule(vocab_size=256, block_size=64, batch_size=4,
                                                           num_samples=12), ckpt_path=ckpt_path)
        return trainer, losses.losses

    trainer, full = fit(callbacks=[ModelCheckpoint(dirpath=out, save_top_k=-1, every_n_train_steps=3)])
    placements = sorted({u.placement.value for u in trainer.strategy.engine.units if u.trained})
    _, resumed = fit(ckpt_path=Path(out) / "epoch=0-step=3.ckpt")
    return {"full": full, "resumed": resumed, "placements": placements}


def test_a_checkpoint_of_state_on_the_gpu_resumes(tmp_path):
    (result,) = call(fit_and_resume, out=str(tmp_path), accelerator_state=1.0)
    assert result["placements"] == ["accelerator"]
    assert len(result["full"]) == 6
    assert result["resumed"] == result["full"][3:]


def test_saving_and_loading_state_on_the_gpu_holds_no_host_copy_of_it(tmp_path):
    # the bench's own measurement: a ~45M-parameter GPT with all its optimizer state on the GPU (0.5 GB)
    out = tmp_path / "bench.json"
    script = ROOT / "scripts" / "bench" / "bench_checkpoint.py"
    subprocess.run([sys.executable, str(script), "--model", "small", "--option", "accelerator_state=1.0", "--dir",
                    str(tmp_path), "--out", str(out)], check=True, timeout=600)
    (run,) = json.loads(out.read_text())["runs"].values()
    state = run["save"][0]["state"]
    assert state["host"] == 0, state
    assert state["accelerator"] > 4e8, state
    assert run["files"] == 2  # meta.pt and the one rank's file
    for phase in ("save", "load"):
        # the 64 MiB staging buffer and the interpreter's own churn, not the state
        assert run[phase][0]["peak_above_before"] < 0.3 * state["accelerator"], (phase, run[phase])
