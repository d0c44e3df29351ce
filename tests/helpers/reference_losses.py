"""Reference implementations, for the tests only: the PPO clipped policy loss and value loss as one-call textbook
functions, written from the training path's pieces (``clipped_surrogate`` + a masked mean, ``value_errors`` + a
masked mean). The training path aggregates over a whole optimizer step instead (``aggregate_loss``); on one
micro-batch with ``token_mean`` the two agree, which ``tests/algorithms/test_ppo_math.py`` checks by hand."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rlhf_lightning.algorithms.losses import value_errors
from rlhf_lightning.algorithms.masked import masked_mean
from rlhf_lightning.algorithms.surrogate import clipped_surrogate


class PolicyLossOutput(NamedTuple):
    """PPO clipped policy loss (differentiable) and detached diagnostics, all 0-dim tensors."""

    loss: Tensor
    clipfrac: Tensor
    approx_kl: Tensor
    ratio_mean: Tensor


def reference_policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_range: float
) -> PolicyLossOutput:
    """PPO-clip loss: masked mean of max(-A * ratio, -A * clamp(ratio, 1 - c, 1 + c)), ratio = pi / pi_old.

    The mean runs over all valid tokens of the minibatch. clipfrac is the share of valid tokens where the
    clipped term is the larger one (no gradient flows there); approx_kl = masked mean of (ratio - 1) - log ratio
    (k3, non-negative). Shapes: ``[B, T]`` inputs -> 0-dim outputs.
    """
    if clip_range < 0:
        raise ValueError(f"clip_range must be >= 0, got {clip_range}.")
    valid = mask.bool()
    surrogate = clipped_surrogate(logprobs, old_logprobs, advantages, valid, clip_range, clip_range)
    loss = masked_mean(surrogate.loss, valid)
    with torch.no_grad():
        clipfrac = masked_mean((surrogate.clipped_low | surrogate.clipped_high).to(surrogate.ratio.dtype), valid)
        approx_kl = masked_mean((surrogate.ratio - 1.0) - torch.log(surrogate.ratio), valid)
        ratio_mean = masked_mean(surrogate.ratio, valid)
    return PolicyLossOutput(loss, clipfrac, approx_kl, ratio_mean)


class ValueLossOutput(NamedTuple):
    """Value-function loss (differentiable) and the detached share of clipped tokens, both 0-dim tensors."""

    loss: Tensor
    clipfrac: Tensor


def reference_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range_value: float | None
) -> ValueLossOutput:
    """Value loss: the masked mean of :func:`value_errors` over the valid tokens, and the share of them where
    the clipped error is the larger one (0 when unclipped). Shapes: ``[B, T]`` inputs -> 0-dim outputs.
    """
    errors, clipped = value_errors(values, old_values, returns, mask, clip_range_value)
    with torch.no_grad():
        clipfrac = masked_mean(clipped.to(errors.dtype), mask)
    return ValueLossOutput(masked_mean(errors, mask), clipfrac)


