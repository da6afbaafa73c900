"""`update_lag=1` (ZeRO-Offload's delayed parameter update) against a delayed AdamW written out by hand on one process:
the host's units take each step's update one step late, so the forward of step t+1 runs on the parameters of step
t-1, while clipping decides on the step's own gradient. On CPU ranks every unit is the host's."""

from __future__ import annotations

import copy
import dataclasses

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import helpers.trainer
from helpers.compare import rel_err
from helpers.fabric_loop import RankRows
from helpers.tiny import token_loader
from helpers.tiny_module import TinyModule, read_probe
from lightning_zoff import ZoffStrategy
from lightning_zoff.placement.plan import StateOptions, host_bytes_per_element

STEPS, BATCH, MAX_NORM = 8, 4, 0.84  # BATCH per rank and micro-batch; 2 ranks


def zoff_run(tmp_path, accumulate: int, steps: int = STEPS, rows: int = 192, callbacks=(), ckpt_path=None,
             **options) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Rank 0's micro-batch losses and the trained weights of a 2-rank zoff fit over the first `rows` samples."""
    pl.seed_everything(7)
    module = TinyModule(step_lr=False)
    inputs, targets = (t[:rows] for t in token_loader().dataset.tensors)  # rank r's rows: r, r + 2, ... in order
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=BATCH, sampler=RankRows(rows, 2))
    helpers.trainer.fit(module, loader, ZoffStrategy(start_method="fork", weights_to_main_process=True, **options),
                        out=tmp_path, max_steps=steps, accumulate=accumulate, clip=MAX_NORM, callbacks=callbacks,
                        ckpt_path=ckpt_path, enable_checkpointing=bool(callbacks), use_distributed_sampler=False)
    probe = read_probe(tmp_path)
    assert probe["held"]["host"] == probe["planned"]["host"]  # the plan holds every byte, the lag's buffers too
    return probe["losses"], module.state_dict()


def delayed_adamw(accumulate: int, lag: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training on one process: torch's AdamW on a master copy; the forward's copy of the parameters gets
    each update `lag` steps late. Rank 0's micro-batch losses (its rows of each global batch) and the masters."""
    pl.seed_everything(7)
    module = TinyModule(step_lr=False)
    forward_model = module.model
    master = copy.deepcopy(module)
    optimizer = master.configure_optimizers()
    pending: list[dict[str, torch.Tensor]] = []
    inputs, targets = token_loader().dataset.tensors
    losses = []
    for step in range(STEPS):
        forward_model.zero_grad()
        for micro in range(accumulate):
            start = (step * accumulate + micro) * 2 * BATCH  # rank r's rows are start + r, start + r + 2, ...
            rows = slice(start, start + 2 * BATCH)
            for rank in (0, 1):  # each rank's mean loss, as DDP averages the ranks' gradients
                x, y = inputs[rows][rank::2], targets[rows][rank::2]
                loss = F.cross_entropy(forward_model(x).flatten(0, 1), y.flatten())
                (loss / (2 * accumulate)).backward()
                if rank == 0:
                    losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(forward_model.parameters(), MAX_NORM)
        for p, q in zip(master.model.parameters(), forward_model.parameters(), strict=True):
            p.grad = q.grad.clone()
        optimizer.step()
        pending.append({name: p.detach().clone() for name, p in master.model.named_parameters()})
        if len(pending) > lag:  # the update `lag` steps old reaches the forward's parameters now
            forward_model.load_state_dict(pending.pop(0), strict=False)
    return losses, master.state_dict()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lag_one_equals_a_delayed_adamw(tmp_path, accumulate):
    losses, weights = zoff_run(tmp_path, accumulate, update_lag=1)
    expected, expected_weights = delayed_adamw(accumulate, lag=1)
    exact, _ = delayed_adamw(accumulate, lag=0)
    assert len(losses) == len(expected) == STEPS * accumulate
    assert rel_err(losses, expected) < 1e-6
    assert rel_err(losses, exact) > 1e-3  # the lag shows: the comparison is not with exact training
    assert weights.keys() == expected_weights.keys()
    for name, value in weights.items():  # the last update applied at the end of fit: the masters
        torch.testing.assert_close(value, expected_weights[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_plan_counts_the_lags_buffers():
    plain = StateOptions(param_bytes=2, moment_bytes=4, moments=2, sum_bytes=4)
    lagging = dataclasses.replace(plain, update_lag=True)
    # 2 B landing, 4 B sum, and the 16-bit copy over the landing buffer; lagging: a second landing buffer and sum, the
    # copy a buffer of its own
    assert host_bytes_per_element(plain) == 12 + 4 + 2
    assert host_bytes_per_element(lagging) == 12 + 2 * (4 + 2) + 2


def test_lag_gives_the_same_bits_with_and_without_overlap(tmp_path):
    overlapped, weights = zoff_run(tmp_path / "overlap", 1, update_lag=1)
    inline, inline_weights = zoff_run(tmp_path / "inline", 1, update_lag=1, overlap=False)
    assert overlapped == inline
    assert all(torch.equal(value, inline_weights[name]) for name, value in weights.items())


def test_lag_zero_is_exact_training(tmp_path):
    losses, _ = zoff_run(tmp_path, 1)
    exact, _ = delayed_adamw(1, lag=0)
    assert rel_err(losses, exact) < 1e-5


def test_a_checkpoint_applies_the_pending_update_and_resumes_bit_for_bit(tmp_path):
    # 24 rows: 3 micro-batches per rank and epoch; the checkpoint at the end of the first epoch. Reading the state for
    # it applies the update still waiting, in the run that saved as in the one that resumes.
    every3 = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_train_steps=3)
    whole, weights = zoff_run(tmp_path / "whole", 1, steps=6, rows=24, callbacks=[every3], update_lag=1)
    resumed, resumed_weights = zoff_run(tmp_path / "resumed", 1, steps=6, rows=24, update_lag=1,
                                        ckpt_path=tmp_path / "ck" / "epoch=0-step=3.ckpt")
    assert resumed == whole[3:]
    assert all(torch.equal(value, resumed_weights[name]) for name, value in weights.items())
