"""The cross entropy of a linear layer's logits (a language model's head) without the logits ever existing whole.

A causal LM's loss on one step holds batch x seq x vocab logits several times over: the head's 16-bit output, the
fp32 copy the loss is computed in, log-softmax's fp32 output kept for backward, and in backward the fp32 and 16-bit
gradients. For Llama-3-8B (vocabulary 128,256) at 4 x 4096 tokens that is about 25 GB of a GPU's memory at once, and
under zoff every GB the step does not hold is a GB of optimizer state that need not live (and be updated) on the host.

`linear_cross_entropy` runs the head and the loss in slices of the vocabulary: forward keeps only each token's
log-sum-exp; backward recomputes each slice's logits, turns them into the slice's gradient (softmax minus the
one-hot target) and multiplies it out at once into the weight's rows and the hidden states' gradient. The math is
the plain path's (`F.cross_entropy(F.linear(h, w, b).float(), y)`): logits in the weight's dtype, the loss in fp32,
the logits' gradient rounded to the weight's dtype before the two products. Only the order of sums differs (the
log-sum-exp over slices, the hidden states' gradient summed over slices in fp32), so results agree to rounding,
exactly in fp64. One extra head matmul per step is the price (2·tokens·vocab·hidden FLOPs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from typing_extensions import override

SLICE_BYTES = 256 * 2**20  # of one vocabulary slice's fp32 logits: the most the loss holds at once, times about 3


def vocab_slice(tokens: int, vocab: int, slice_bytes: int = SLICE_BYTES) -> int:
    """Rows of the weight per slice: a slice's fp32 logits stay within `slice_bytes`."""
    return max(1, min(vocab, slice_bytes // (4 * max(1, tokens))))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, ignore_index: int = -100, slice_bytes: int = SLICE_BYTES
                         ) -> torch.Tensor:
    """The mean cross entropy of `F.linear(hidden, weight, bias)` against `targets` (over the targets that are not
    `ignore_index`), computed in fp32; `hidden` (..., H) and `targets` (...) of the same leading shape."""
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    if flat_targets.numel() != flat_hidden.shape[0]:
        raise ValueError(f"linear_cross_entropy: {flat_hidden.shape[0]} hidden states but {flat_targets.numel()}"
                         " targets")
    step = vocab_slice(flat_hidden.shape[0], weight.shape[0], slice_bytes)
    return _LinearCrossEntropy.apply(flat_hidden, weight, bias, flat_targets, ignore_index, step)


def _loss_dtype(head_dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for an fp64 head."""
    return torch.promote_types(head_dtype, torch.float32)


def _slices(vocab: int, step: int) -> list[tuple[int, int]]:
    """The vocabulary's slices, [start, end) each."""
    return [(start, min(vocab, start + step)) for start in range(0, vocab, step)]


def _slice_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, start: int, end: int
                  ) -> torch.Tensor:
    """The head's logits of one slice, in the weight's dtype (or autocast's), as the head computes them."""
    return F.linear(hidden, weight[start:end], None if bias is None else bias[start:end])


def _at_target(targets: torch.Tensor, kept: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows' targets fall in the slice [start, end), and each row's target column there (clamped where not):
    gather and scatter by these need no sync with the GPU."""
    inside = kept & (targets >= start) & (targets < end)
    return inside, (targets - start).clamp(0, end - start - 1).unsqueeze(1)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    @override
    def forward(ctx, hidden, weight, bias, targets, ignore_index, step):
        device_type = hidden.device.type
        # recomputed in backward under the same autocast state, so the logits there are these, bit for bit
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        kept = targets != ignore_index
        vocab = weight.shape[0]
        lse_parts: list[torch.Tensor] = []
        target_logit = torch.zeros(hidden.shape[0], dtype=_loss_dtype(weight.dtype), device=hidden.device)
        head_dtype = weight.dtype
        for start, end in _slices(vocab, step):
            logits = _slice_logits(hidden, weight, bias, start, end)
            head_dtype = logits.dtype  # the weight's, or autocast's
            logits = logits.to(_loss_dtype(head_dtype))
            lse_parts.append(torch.logsumexp(logits, dim=1))
            inside, column = _at_target(targets, kept, start, end)
            target_logit = torch.where(inside, logits.gather(1, column).squeeze(1), target_logit)
            del logits
        lse = torch.logsumexp(torch.stack(lse_parts, dim=1), dim=1)
        count = kept.sum()
        losses = torch.where(kept, lse - target_logit, torch.zeros_like(lse))
        ctx.save_for_backward(hidden, weight, bias, targets, lse, count)
        ctx.ignore_index, ctx.step, ctx.head_dtype = ignore_index, step, head_dtype
        return losses.sum() / count  # NaN when every target is ignored, as F.cross_entropy gives

    @staticmethod
    @override
    def backward(ctx, grad_loss):
        hidden, weight, bias, targets, lse, count = ctx.saved_tensors
        device_type, autocast_on, autocast_dtype = ctx.autocast
        kept = targets != ctx.ignore_index
        # d loss / d logit = (softmax - one_hot) / count on kept rows, 0 on ignored ones
        row_scale = ((grad_loss.to(lse.dtype) / count) * kept.to(lse.dtype)).unsqueeze(1)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        head_hidden = hidden.to(ctx.head_dtype)  # the products run in the head's dtype, as the plain path's do
        grad_hidden = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        grad_bias = torch.empty_like(bias) if need_bias else None
        vocab = weight.shape[0]
        for start, end in _slices(vocab, ctx.step):
            with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                logits = _slice_logits(hidden, weight, bias, start, end)
            grad = logits.to(lse.dtype).sub_(lse.unsqueeze(1)).exp_()  # softmax
            inside, column = _at_target(targets, kept, start, end)
            grad.scatter_add_(1, column, -inside.to(grad.dtype).unsqueeze(1))
            grad = grad.mul_(row_scale).to(ctx.head_dtype)  # as the gradient of the head's 16-bit output
            if grad_hidden is not None:
                grad_hidden += grad @ weight[start:end].to(ctx.head_dtype)
            if grad_weight is not None:
                grad_weight[start:end] = grad.t() @ head_hidden
            if grad_bias is not None:
                grad_bias[start:end] = grad.sum(0)
            del logits, grad
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None
