import itertools
import math

import torch
from torch.utils.data import DistributedSampler

from lightning_zoff.app.resumable import ResumableLoader
from lightning_zoff.examples.corpus import ByteWindows, CorpusDataModule, stdlib_bytes
from lightning_zoff.examples.gpt import GPT, GPTConfig, GPTModule

SMALL = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


def test_gpt_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    model = GPT(SMALL)
    idx = torch.randint(256, (4, 32))
    logits, loss = model(idx, idx)
    assert logits.shape == (4, 32, 256)
    assert loss.dtype == torch.float32
    # small init: near-uniform predictions over 256 bytes
    assert abs(loss.item() - math.log(256)) < 0.1
    _, no_loss = model(idx)
    assert no_loss is None


def test_gpt_loss_decreases_on_one_batch():
    torch.manual_seed(0)
    model = GPT(SMALL)
    x = torch.randint(256, (4, 33))
    inputs, targets = x[:, :-1], x[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        _, loss = model(inputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_gpt_init_is_deterministic_and_weights_tie():
    torch.manual_seed(0)
    a = GPT(SMALL)
    torch.manual_seed(0)
    b = GPT(SMALL)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert all((p == 0).all() for n, p in a.named_parameters() if n.endswith("qkv.bias"))
    tied = GPT(GPTConfig(**{**SMALL.__dict__, "tie_weights": True}))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert tied.num_params() == a.num_params() - 256 * 32


def test_optimizer_groups_and_scheduler():
    module = GPTModule(block_size=32, n_layer=1, n_head=2, n_embd=32, lr_step_size=5)
    config = module.configure_optimizers()
    decay, no_decay = config["optimizer"].param_groups
    assert decay["weight_decay"] == 0.1
    assert no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    decayed = {id(p) for p in decay["params"]}
    assert id(module.model.tok_emb.weight) not in decayed
    assert id(module.model.lm_head.weight) in decayed
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.parameters()))
    assert config["lr_scheduler"]["interval"] == "step"


def test_sample_returns_prompt_and_new_bytes():
    torch.manual_seed(0)
    module = GPTModule(block_size=16, n_layer=1, n_head=2, n_embd=32)
    out = module.sample(b"def ", 20, top_k=10)  # longer than block_size: the context is cropped
    assert isinstance(out, bytes)
    assert out.startswith(b"def ")
    assert len(out) == 24


def test_byte_windows_deterministic_non_overlapping_shifted():
    tokens = torch.arange(1000) % 256
    windows = ByteWindows(tokens, block_size=16)
    assert len(windows) == 999 // 16
    x0, y0 = windows[0]
    x1, _ = windows[1]
    assert x0.dtype == torch.int64
    assert x0.shape == (16,)
    assert torch.equal(y0[:-1], x0[1:])
    assert y0[-1] == x1[0]
    assert torch.equal(x1, tokens[16:32])  # the next window starts where the last one ended
    assert torch.equal(windows[7][0], ByteWindows(tokens, 16)[7][0])


def test_corpus_reads_stdlib_source():
    data = stdlib_bytes(max_bytes=2_000_000)
    assert len(data) == 2_000_000  # the stdlib holds well over 1 MB of .py source
    assert b"def " in data
    assert b"import " in data
    assert stdlib_bytes(max_bytes=10_000) == data[:10_000]


def test_corpus_datamodule_splits():
    dm = CorpusDataModule(block_size=64, batch_size=4, max_bytes=200_000, val_fraction=0.05)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 64)
    assert len(dm.val_set) == len(dm.test_set) == 10_000 // 64
    first = next(iter(dm.train_dataloader()))[0]
    assert torch.equal(first, x)  # seeded shuffle: the same order every time


def test_the_training_loader_continues_mid_epoch_after_load_state_dict():
    data = list(range(20))
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    loader = ResumableLoader(data, batch_size=2, sampler=sampler)  # 5 batches a rank and epoch
    sampler.set_epoch(1)
    whole = [batch.tolist() for batch in loader]
    seen = list(itertools.islice(iter(loader), 2))
    state = loader.state_dict()
    assert state == {"batches": 2, "epoch": 1}
    assert [batch.tolist() for batch in seen] == whole[:2]
    resumed = ResumableLoader(data, batch_size=2, sampler=DistributedSampler(data, 2, 1, shuffle=True, seed=3))
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)
    assert [batch.tolist() for batch in resumed] == whole[2:]  # the rest of the epoch, as it would have come
    assert [batch.tolist() for batch in resumed] == whole  # and the next pass whole
    # a state of another epoch, or of a finished one, leaves the next epoch whole
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(2)
    assert len(list(resumed)) == 5
    resumed.load_state_dict({"batches": 5, "epoch": 2})
    assert len(list(resumed)) == 5
