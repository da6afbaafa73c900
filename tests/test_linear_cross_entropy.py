"""The head's loss in vocabulary slices (`linear_cross_entropy`) against the plain path, `F.cross_entropy` of the whole
logits: the same loss and gradients (exactly in fp64, to rounding in 16 bits), never a tokens x vocab tensor, and the
Hugging Face example's `LossHead` giving the model's own loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_zoff.examples.hf import HFCausalLM, LossHead
from lightning_zoff.ops.linear_cross_entropy import linear_cross_entropy, vocab_slice

TOKENS, HIDDEN, VOCAB = 37, 16, 101


def inputs(dtype: torch.dtype, bias: bool = True, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, dtype=dtype, generator=gen).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, dtype=dtype, generator=gen).requires_grad_()
    b = torch.randn(VOCAB, dtype=dtype, generator=gen).requires_grad_() if bias else None
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    targets[[3, 5]] = -100  # ignored, as padding is
    return hidden, weight, b, targets


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference against the reference's largest magnitude (ignored rows' gradients are zero)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def plain(hidden, weight, bias, targets):
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets)


def loss_and_grads(fn, hidden, weight, bias, targets):
    loss = fn(hidden, weight, bias, targets)
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    return loss, torch.autograd.grad(loss, leaves)


# a slice of 10 vocabulary rows: 11 slices, the last one short
SLICED = dict(slice_bytes=4 * TOKENS * 10)


@pytest.mark.parametrize("bias", [True, False])
def test_fp64_equals_the_plain_loss_and_gradients(bias):
    args = inputs(torch.float64, bias)
    loss, grads = loss_and_grads(lambda *a: linear_cross_entropy(*a, **SLICED), *args)
    ref_loss, ref_grads = loss_and_grads(plain, *args)
    assert vocab_slice(TOKENS, VOCAB, SLICED["slice_bytes"]) == 10
    assert abs(loss.item() - ref_loss.item()) < 1e-12
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert rel_err(grad, ref) < 1e-12


def test_bf16_agrees_to_rounding():
    args = inputs(torch.bfloat16)
    loss, grads = loss_and_grads(lambda *a: linear_cross_entropy(*a, **SLICED), *args)
    ref_loss, ref_grads = loss_and_grads(plain, *args)
    assert loss.dtype == torch.float32  # computed in fp32, as the plain path's
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    # the weight's and bias's rows come from one product each, as the plain path's; the hidden states' gradient is
    # summed over slices, each rounded to bf16 once
    hidden_grad, weight_grad, bias_grad = grads
    assert torch.equal(weight_grad, ref_grads[1])
    assert torch.equal(bias_grad, ref_grads[2])
    assert rel_err(hidden_grad, ref_grads[0]) < 2e-2


def test_under_autocast_the_logits_are_autocasts():
    hidden, weight, bias, targets = inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = loss_and_grads(lambda *a: linear_cross_entropy(*a, **SLICED), hidden, weight, bias, targets)
        ref_loss, ref_grads = loss_and_grads(plain, hidden, weight, bias, targets)
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert grad.dtype == ref.dtype == torch.float32
        assert rel_err(grad, ref) < 2e-2


def test_every_target_ignored_gives_nan_as_cross_entropy_does():
    hidden, weight, bias, targets = inputs(torch.float64)
    targets[:] = -100
    assert torch.isnan(linear_cross_entropy(hidden, weight, bias, targets))
    assert torch.isnan(plain(hidden, weight, bias, targets))


class LargestTensor(TorchDispatchMode):
    """The most elements any op's output held."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


def test_no_tensor_of_tokens_by_vocab_exists():
    hidden, weight, bias, targets = inputs(torch.float32)
    with LargestTensor() as largest:
        loss_and_grads(lambda *a: linear_cross_entropy(*a, **SLICED), hidden, weight, bias, targets)
    assert largest.numel <= max(TOKENS * 10, VOCAB * HIDDEN)  # a slice's logits, or the weight's gradient
    with LargestTensor() as largest:
        loss_and_grads(plain, hidden, weight, bias, targets)
    assert largest.numel == TOKENS * VOCAB  # what the plain path holds (several times over)


def test_mismatched_targets_are_refused():
    hidden, weight, bias, targets = inputs(torch.float32)
    with pytest.raises(ValueError, match="37 hidden states but 36 targets"):
        linear_cross_entropy(hidden, weight, bias, targets[1:])


@pytest.mark.parametrize("preset", ["llama_tiny", "qwen3_tiny", "opt_tiny"])
def test_the_hf_example_loss_is_the_models_own(preset):
    torch.manual_seed(0)
    module = HFCausalLM(preset).double()
    head = module.model.get_output_embeddings()
    assert isinstance(head, LossHead)
    assert (head.weight is module.model.get_input_embeddings().weight) == (preset != "llama_tiny")  # ties kept
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 256, (2, 16), generator=gen), torch.randint(0, 256, (2, 16), generator=gen)
    params = list(module.parameters())
    loss = module.loss((x, y))
    grads = torch.autograd.grad(loss, params)
    ref = F.cross_entropy(module(x).flatten(0, 1), y.flatten())  # the model's logits, unarmed
    ref_grads = torch.autograd.grad(ref, params)
    assert abs(loss.item() - ref.item()) < 1e-12
    scale = max(g.abs().max().item() for g in ref_grads)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert (grad - ref_grad).abs().max().item() < 1e-12 * scale
    assert head.targets is None  # disarmed after the loss
    assert "model.lm_head.weight" in module.state_dict()
