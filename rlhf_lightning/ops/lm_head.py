"""Log-probabilities of chosen tokens straight from hidden states and the LM head's weight, fused.

With a large vocabulary the ``[N, V]`` logits are the biggest tensors of an RL step, and on a CPU the
element-wise passes over them (temperature, log-sum-exp, its backward, the gather's backward) cost as much as
the matmuls. Here the logits buffer is turned into the softmax in place, that one tensor is all the backward
keeps, and the backward builds the logits' gradient from it in one more: two ``[N, V]`` allocations per
forward and backward instead of about eight. :func:`head_logprobs` is the dispatcher the policy calls: chunked or
not, fused where the head allows it, plain otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rlhf_lightning.algorithms.losses import entropy_from_logits, logprobs_from_logits
from rlhf_lightning.utils.flops import count_head


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


def head_logprobs(hidden: Tensor, labels: Tensor, logits: Callable[[Tensor], Tensor], temperature: float = 1.0, *,
                  chunk: int | None = None, with_entropy: bool = False, entropy_grad: bool = True,
                  fused_weight: Tensor | None = None, fused_scale: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """``(log-probs, entropy or None)`` of ``labels`` ``[B, T]`` under ``softmax(logits(hidden) / temperature)``,
    ``hidden`` ``[B, T, H]``: the one entry point of the policy's log-probs.

    ``chunk``: take this many positions at a time and, when a gradient is needed, recompute each chunk's logits in
    the backward pass instead of keeping them (the ``[B, T, V]`` logits never exist at once); null = all at once.
    ``fused_weight``: when ``logits(h)`` is ``fused_scale * h @ fused_weight.T`` (a bias-free linear head whose
    post-processing is a pure scale), :func:`logprobs_from_hidden` computes it without materialising the
    softmax's intermediates; it is used unless an entropy bonus needs the entropy's gradient. Null = the plain
    path: logits, then log-softmax. ``entropy_grad=False`` makes the entropy a detached statistic.
    """
    recompute = chunk is not None and torch.is_grad_enabled() and hidden.requires_grad
    if fused_weight is not None and not (with_entropy and entropy_grad and torch.is_grad_enabled()):
        def compute(piece: Tensor, piece_labels: Tensor) -> tuple[Tensor, Tensor | None]:
            count_head(piece.shape[0] * piece.shape[1])  # the head's module is not called: a FLOP count is told
            # logits * scale / temperature = hidden @ W.T / (temperature / scale)
            return logprobs_from_hidden(piece, fused_weight, piece_labels, temperature / fused_scale, with_entropy)
    else:
        def compute(piece: Tensor, piece_labels: Tensor) -> tuple[Tensor, Tensor | None]:
            # Contiguous first: matmul does not fold a strided slice that requires grad into one 2-D product.
            piece_logits = logits(piece.contiguous()).float() / temperature
            entropy = None
            if with_entropy:
                with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
                    entropy = entropy_from_logits(piece_logits if entropy_grad else piece_logits.detach())
            return logprobs_from_logits(piece_logits, piece_labels), entropy
    step = chunk or max(labels.shape[1], 1)
    logprobs, entropies = [], []
    for first in range(0, labels.shape[1], step):
        piece, piece_labels = hidden[:, first : first + step], labels[:, first : first + step]
        if recompute:
            logprob, entropy = checkpoint(compute, piece, piece_labels, use_reentrant=False)
        else:
            logprob, entropy = compute(piece, piece_labels)
        logprobs.append(logprob)
        entropies.append(entropy)
    return torch.cat(logprobs, 1), torch.cat(entropies, 1) if with_entropy else None
