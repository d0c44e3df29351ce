"""Log-probabilities of any role of the shared base, from a mask of the positions wanted: left-padded rollouts and
right-padded preference pairs alike, the LM head applied only where it is needed."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.algorithms import entropy_from_logits, logprobs_from_logits
from rlhf_lightning.models.sharding import is_dtensor
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.ops.lm_head import head_logprobs


def first_marked(response_mask: Tensor) -> int:
    """The first column ``response_mask`` ``[B, T]`` marks in any row (at least 1: a first token has no
    prediction)."""
    marked = response_mask.any(0).nonzero()
    if marked.numel() == 0 or int(marked[0]) == 0:
        raise ValueError("response_mask must mark at least one token after the first column")
    return int(marked[0])


def predicting_hidden_states(model: SharedBase, role: str | None, input_ids: Tensor, attention_mask: Tensor,
                             response_mask: Tensor) -> tuple[Tensor, int]:
    """``(hidden states [B, T - start, H], start)`` of ``role`` at the positions that predict tokens
    ``start .. T-1``, where ``start`` is the first column ``response_mask`` marks in any row; rows whose columns
    before ``start`` are equal (a group's prompt) share their computation when the model's ``share_prompt`` is on."""
    start = first_marked(response_mask)
    with model.role(role):
        hidden = model.hidden_states(input_ids, attention_mask, shared_until=start)
    return hidden[:, start - 1 : -1], start


def token_logprobs(model: SharedBase, role: str | None, input_ids: Tensor, attention_mask: Tensor,
                   response_mask: Tensor, temperature: float = 1.0, chunk: int | None = None, *,
                   with_entropy: bool = False, entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
    """``(log-probs [B, T], entropy [B, T] or None)`` of the tokens of ``input_ids`` under ``role`` at
    ``temperature``, on the positions ``response_mask`` ``[B, T]`` marks (0 before the first of them).

    The LM head runs only from the first marked column on, optionally ``chunk`` positions at a time, so the full
    ``[B, T, V]`` logits never exist at once; with a chunk size, each chunk's logits are recomputed in the backward
    pass rather than kept. ``entropy_grad=False`` computes the entropy as a detached statistic, so its ``[B, T, V]``
    softmax is not kept for a backward. The logits are the model's own, post-processing included (Gemma-2's soft
    cap; see :mod:`rlhf_lightning.models.logits`); for a model whose post-processing is not recognised they come
    from its full forward pass.
    """
    if model.logit_transform is None:
        return _forward_logprobs(model, role, input_ids, attention_mask, response_mask, temperature, with_entropy,
                                 entropy_grad)
    hidden, start = predicting_hidden_states(model, role, input_ids, attention_mask, response_mask)
    logprobs, entropy = head_logprobs(hidden, input_ids[:, start:], model.logits, temperature, chunk=chunk,
                                      with_entropy=with_entropy, entropy_grad=entropy_grad, **_fused_head(model))
    left = input_ids.new_zeros((input_ids.shape[0], start), dtype=logprobs.dtype)
    return torch.cat([left, logprobs], 1), None if entropy is None else torch.cat([left, entropy], 1)


def _forward_logprobs(model: SharedBase, role: str | None, input_ids: Tensor, attention_mask: Tensor,
                      response_mask: Tensor, temperature: float, with_entropy: bool,
                      entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
    """:func:`token_logprobs` through the model's full forward pass, for models whose logit post-processing cannot be
    reproduced from the hidden states."""
    start = first_marked(response_mask)
    with model.role(role):
        logits = model.next_token_logits(input_ids, attention_mask, start).float() / temperature
    left = input_ids.new_zeros((input_ids.shape[0], start), dtype=logits.dtype)
    logprobs = torch.cat([left, logprobs_from_logits(logits, input_ids[:, start:])], 1)
    if not with_entropy:
        return logprobs, None
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return logprobs, torch.cat([left, entropy], 1)


def _fused_head(model: SharedBase) -> dict[str, Any]:
    """The fused log-prob head's arguments when the logits are a scaled bias-free linear head, else none."""
    head, transform = model.lm_head, model.logit_transform
    if not (isinstance(head, torch.nn.Linear) and head.bias is None and transform.is_linear):
        return {}
    if is_dtensor(head.weight):  # FSDP2 keeps the root unit gathered after a forward pass; never a shard here
        raise RuntimeError("the LM head's weight is a shard: log-probs must follow a hidden_states pass")
    return {"fused_weight": head.weight, "fused_scale": transform.scale}
