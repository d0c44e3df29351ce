"""Log-probabilities of chosen tokens straight from hidden states and the LM head's weight, fused.

With a large vocabulary the ``[N, V]`` logits are the biggest tensors of an RL step, and on a CPU the
element-wise passes over them (temperature, log-sum-exp, its backward, the gather's backward) cost as much as
the matmuls. Here the logits buffer is turned into the softmax in place, that one tensor is all the backward
keeps, and the backward builds the logits' gradient from it in one more: two ``[N, V]`` allocations per
forward and backward instead of about eight.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _HeadLogprobs(torch.autograd.Function):
    """``log softmax(hidden @ weight.T / temperature)[label]`` and, optionally, the (detached) entropy."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float,
                with_entropy: bool) -> tuple[Tensor, Tensor]:
        scaled = hidden / temperature if temperature != 1.0 else hidden
        logits = scaled @ weight.t()  # under autocast a low-precision matmul; the softmax is taken in fp32
        ctx.matmul_dtype = logits.dtype
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        peak = logits.amax(-1, keepdim=True)
        probs = logits.sub_(peak).exp_()
        total = probs.sum(-1, keepdim=True)
        probs.div_(total)
        logprobs = picked - (peak + total.log()).squeeze(-1)
        entropy = torch.special.entr(probs).sum(-1) if with_entropy else logprobs.new_empty(0)
        ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(scaled, weight, labels, probs)
        ctx.temperature = temperature
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor, grad_entropy: Tensor):
        scaled, weight, labels, probs = ctx.saved_tensors
        # d logprob / d logits = onehot(label) - softmax, times the incoming gradient. A new buffer rather than
        # the saved one in place: a graph kept with retain_graph may be differentiated again.
        grad_logits = probs * -grad_logprobs.unsqueeze(-1)
        grad_logits.scatter_add_(-1, labels.unsqueeze(-1), grad_logprobs.unsqueeze(-1))
        grad_logits = grad_logits.to(ctx.matmul_dtype)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = (grad_logits @ weight.to(ctx.matmul_dtype)).to(scaled.dtype)
            if ctx.temperature != 1.0:
                grad_hidden = grad_hidden / ctx.temperature
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_logits.t() @ scaled.to(ctx.matmul_dtype)).to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def logprobs_from_hidden(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0,
                         with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """``(log-probs, entropy or None)`` of ``labels`` under ``softmax(hidden @ weight.T / temperature)``.

    Equal to ``logprobs_from_logits(linear(hidden, weight) / temperature, labels)`` (and
    ``entropy_from_logits``), differentiable in ``hidden`` and ``weight``; the entropy is a detached statistic.
    Shapes: ``hidden`` ``[..., H]``, ``weight`` ``[V, H]``, ``labels`` ``[...]`` -> ``[...]``.
    """
    shape = labels.shape
    logprobs, entropy = _HeadLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                            float(temperature), with_entropy)
    return logprobs.view(shape), entropy.view(shape) if with_entropy else None
