"""Per-token quantities of the losses: log-probs and entropies from logits, the clipped value error, explained
variance. (The policy loss is :func:`~rlhf_lightning.algorithms.surrogate.clipped_surrogate` aggregated by
:func:`~rlhf_lightning.algorithms.surrogate.aggregate_loss`.)"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_lightning.algorithms.masked import masked_var


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label] = logits[label] - logsumexp(logits), without a ``[..., V]`` log-softmax.

    Shapes: ``logits`` ``[..., V]``, ``labels`` ``[...]`` (integer) -> ``[...]``.
    """
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits): H = logsumexp(z) - sum_v softmax(z)_v * z_v. Shapes: ``[..., V]`` -> ``[...]``."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def value_errors(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range_value: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)``, V_clip = V_old + clamp(V - V_old, -c, c),
    and where the clipped error is the larger one: ``([B, T], [B, T] bool)``, 0 / False at padding.

    With ``clip_range_value=None`` it is the plain ``0.5 * (V - R)^2`` and nothing is clipped.
    """
    valid = mask.bool()
    # Keep padding finite so masked-out tokens get a zero, not NaN, gradient.
    values = torch.where(valid, values, torch.zeros_like(values))
    old_values = torch.where(valid, old_values, torch.zeros_like(old_values))
    returns = torch.where(valid, returns, torch.zeros_like(returns))
    unclipped = (values - returns) ** 2
    if clip_range_value is None:
        return 0.5 * unclipped, torch.zeros_like(valid)
    if clip_range_value < 0:
        raise ValueError(f"clip_range_value must be >= 0 or None, got {clip_range_value}.")
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped) & valid


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """Share of the returns' variance the value head explains: 1 - var(R - V) / var(R), over valid tokens.

    Uses unbiased masked variances. When var(R) == 0 the ratio is undefined and 0 is returned instead of
    NaN/inf. A diagnostic, so no gradient. Shapes: ``[B, T]`` inputs -> 0-dim output.
    """
    var_returns = masked_var(returns, mask)
    var_residual = masked_var(returns - values, mask)
    safe_var_returns = torch.where(var_returns > 0, var_returns, torch.ones_like(var_returns))
    return torch.where(var_returns > 0, 1.0 - var_residual / safe_var_returns, torch.zeros_like(var_returns))
