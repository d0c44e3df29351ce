"""Clipped surrogate of the critic-free family (token ratio as in GRPO/DAPO, sequence ratio as in GSPO or TRL's
RLOO), CISPO's clipped-weight objective, and loss aggregation that stays exact under gradient accumulation and data parallelism.

Why a separate normaliser. "Mean" in these losses has three meanings (see ALGORITHMS.md, "Loss aggregation"):
the token mean over the batch (DAPO, verl's and TRL's default), the mean over sequences of per-sequence token
means (original GRPO), or a sum over a constant B * max_length (Dr. GRPO). An optimizer step, though, usually
sees its batch in several micro-batches, on several ranks. Taking the mean inside each micro-batch and
averaging those means gives every micro-batch the same weight, so a token of a short micro-batch counts more
than a token of a long one, and the result is not the loss of the batch as a whole. Instead,
:func:`loss_normaliser` gives each micro-batch's share of the step's denominator (its valid tokens, its rows,
or rows * max_length); the caller sums those shares over every micro-batch and rank of the optimizer step
(before the first backward, e.g. with an all-reduce) and passes that total to :func:`aggregate_loss`, which
only sums the micro-batch's numerator and divides by it. The gradients accumulated over the micro-batches are
then exactly those of one big batch. Frameworks that themselves average over micro-batches or ranks (Lightning
divides each loss by ``accumulate_grad_batches``; DDP averages gradients over ranks) need the total divided by
those counts, or the loss multiplied by them.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor

from rlhf_lightning.algorithms.masked import masked_mean, masked_sum

RatioLevel = Literal["token", "sequence", "sequence_sum"]
LossAggregation = Literal["token_mean", "sequence_mean", "constant"]
_LEVELS: tuple[str, ...] = get_args(RatioLevel)
_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)


class SurrogateOutput(NamedTuple):
    """Per-token clipped surrogate and its detached diagnostics, all ``[B, T]``.

    ``loss``: differentiable per-token loss, 0 at padding. ``ratio``: detached importance ratio (1 at
    padding, whose log-ratio is zeroed). ``clipped_low`` / ``clipped_high``: bool, tokens where the lower /
    upper clip bound is active (no gradient flows there); False at padding.
    """

    loss: Tensor
    ratio: Tensor
    clipped_low: Tensor
    clipped_high: Tensor


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    level: RatioLevel = "token",
) -> SurrogateOutput:
    """Per-token PPO-clip loss l_t = -min(rho_t A_t, clip(rho_t, 1 - clip_low, 1 + clip_high) A_t).

    ``level="token"``: rho_t = exp(lp_t - lp_old_t). ``level="sequence"`` (GSPO, Zheng et al. 2025; TRL's
    ``importance_sampling_level="sequence"``): one ratio per response, rho = exp(sum_t m (lp - lp_old) / sum_t m),
    the geometric mean of its token ratios, on each of its tokens. ``level="sequence_sum"`` (TRL 1.16's
    ``RLOOTrainer``): one ratio per response, rho = exp(sum_t m (lp - lp_old)), the product of its token ratios,
    on each of its tokens (aggregated with ``sequence_mean`` it is TRL's per-response loss, averaged over
    responses). Unequal bounds give DAPO's clip-higher.
    clipped_low = rho < 1 - clip_low and A < 0; clipped_high = rho > 1 + clip_high and A > 0 (TRL's flags).
    Computed in at least float32 (a bf16 sum of log-ratios over a long response loses the ratio).
    Shapes: ``logprobs``, ``old_logprobs``, ``advantages`` (a sequence advantage already broadcast), ``mask``
    ``[B, T]`` -> :class:`SurrogateOutput` of ``[B, T]`` tensors. Aggregate ``loss`` with :func:`aggregate_loss`.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low} and {clip_high}.")
    valid, log_ratio, advantages = _ratio_and_advantages(logprobs, old_logprobs, advantages, mask, level)
    ratio = torch.exp(log_ratio)
    surrogate = torch.minimum(
        ratio * advantages, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    )
    # Already 0 at padding, where the advantage was zeroed and the ratio is 1.
    loss = -surrogate
    with torch.no_grad():
        ratio = ratio.detach()
        clipped_low = (ratio < 1.0 - clip_low) & (advantages < 0) & valid
        clipped_high = (ratio > 1.0 + clip_high) & (advantages > 0) & valid
    return SurrogateOutput(loss, ratio, clipped_low, clipped_high)


def log_importance_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, level: RatioLevel) -> Tensor:
    """``[B, T]`` log importance ratios at ``level`` (see :func:`clipped_surrogate`), 0 at padding, in at least
    float32; differentiable in ``logprobs``."""
    if level not in _LEVELS:
        raise ValueError(f"Unknown ratio level {level!r}; expected one of {', '.join(_LEVELS)}.")
    valid = mask.bool()
    dtype = torch.promote_types(torch.result_type(logprobs, old_logprobs), torch.float32)
    zero = torch.zeros((), dtype=dtype, device=valid.device)
    # Zero the log-ratio at padding before exp: garbage there could overflow to inf, and inf in the forward
    # pass turns the zero gradient of the padding into NaN (0 * inf) on the way back.
    log_ratio = torch.where(valid, logprobs.to(dtype) - old_logprobs.to(dtype), zero)
    if level == "sequence":
        lengths = valid.sum(dim=1, keepdim=True).clamp(min=1).to(dtype)
        log_ratio = torch.where(valid, log_ratio.sum(dim=1, keepdim=True) / lengths, zero)
    elif level == "sequence_sum":
        log_ratio = torch.where(valid, log_ratio.sum(dim=1, keepdim=True), zero)
    return log_ratio


def _ratio_and_advantages(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                          level: RatioLevel) -> tuple[Tensor, Tensor, Tensor]:
    """``(valid, log-ratio, advantages)``: the bool mask, the log-ratios at ``level`` and the advantages zeroed at
    padding, both in the log-ratio's dtype."""
    valid = mask.bool()
    log_ratio = log_importance_ratio(logprobs, old_logprobs, valid, level)
    return valid, log_ratio, torch.where(valid, advantages.to(log_ratio.dtype), 0.0)


def cispo_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    max_weight: float,
    min_weight: float | None = None,
    level: RatioLevel = "token",
) -> SurrogateOutput:
    """Per-token CISPO loss l_t = -sg(clip(rho_t, min_weight, max_weight)) A_t log pi(y_t) (MiniMax-M1, Chen et
    al. 2025): the importance weight is clipped and detached instead of the objective, so every token keeps a
    gradient (A_t w_t grad log pi), the clipped ones too.

    TRL 1.16's ``loss_type="cispo"`` is ``min_weight=None`` (no lower bound) and ``max_weight`` its
    ``epsilon_high`` taken as an absolute cap (ScaleRL recommends 5.0): ``-clamp(coef_1, max=epsilon_high).detach()
    * advantages * per_token_logps``. The paper writes the bounds as 1 - eps_low and 1 + eps_high.
    ``level`` as in :func:`clipped_surrogate`. clipped_high = rho > max_weight and A > 0 (TRL's
    ``cispo_clip_ratio``); clipped_low = rho < min_weight and A < 0. Shapes as :func:`clipped_surrogate`.
    """
    if max_weight <= 0 or (min_weight is not None and not 0 <= min_weight < max_weight):
        raise ValueError(f"CISPO's weight bounds must satisfy 0 <= min_weight < max_weight, got {min_weight} and "
                         f"{max_weight}.")
    valid, log_ratio, advantages = _ratio_and_advantages(logprobs, old_logprobs, advantages, mask, level)
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(min=min_weight, max=max_weight)
    loss = -weight * advantages * torch.where(valid, logprobs.to(log_ratio.dtype), 0.0)
    clipped_low = (ratio < (min_weight if min_weight is not None else 0.0)) & (advantages < 0) & valid
    clipped_high = (ratio > max_weight) & (advantages > 0) & valid
    return SurrogateOutput(loss, ratio, clipped_low, clipped_high)


def _check_mode(mode: str) -> None:
    if mode not in _AGGREGATIONS:
        raise ValueError(f"Unknown loss aggregation {mode!r}; expected one of {', '.join(_AGGREGATIONS)}.")


def loss_normaliser(mask: Tensor, mode: LossAggregation, max_length: int | None = None) -> Tensor:
    """This micro-batch's share of the optimizer step's loss denominator; sum it over the step, see above.

    ``token_mean``: its number of valid tokens. ``sequence_mean``: its number of rows (responses, empty ones
    included). ``constant`` (Dr. GRPO): rows * ``max_length``, the longest allowed response (required).
    Shapes: ``mask`` ``[B, T]`` -> 0-dim float32 on ``mask``'s device.
    """
    _check_mode(mode)
    if mode == "token_mean":
        return mask.bool().sum().to(torch.float32)
    rows = float(mask.shape[0])
    if mode == "sequence_mean":
        return torch.tensor(rows, device=mask.device)
    if max_length is None or max_length < 1:
        raise ValueError(f"Loss aggregation 'constant' needs max_length >= 1, got {max_length}.")
    return torch.tensor(rows * max_length, device=mask.device)


def aggregate_loss(
    per_token: Tensor, mask: Tensor, mode: LossAggregation, normaliser: Tensor | float
) -> Tensor:
    """This micro-batch's term of the step's loss: its numerator over the step's total ``normaliser``.

    ``token_mean`` and ``constant``: sum_{i,t} m l / normaliser. ``sequence_mean``:
    sum_i (sum_t m l / max(sum_t m, 1)) / normaliser, an empty row contributing 0. ``normaliser`` is the sum of
    :func:`loss_normaliser` over every micro-batch and rank of the optimizer step (with one micro-batch, that
    micro-batch's own: the plain token mean, sequence mean or Dr. GRPO loss). A zero normaliser (nothing valid
    in the whole step) gives 0, not NaN. Padding may hold inf or NaN: it is selected away, not multiplied by 0.
    Shapes: ``per_token``, ``mask`` ``[B, T]``; ``normaliser`` 0-dim or a number -> 0-dim.
    """
    _check_mode(mode)
    if mode == "sequence_mean":
        numerator = masked_mean(per_token, mask, dim=1).sum()
    else:
        numerator = masked_sum(per_token, mask)
    normaliser = torch.as_tensor(normaliser, dtype=numerator.dtype, device=numerator.device)
    # Checked on the tensor rather than with an `if`, which would cost a device sync per micro-batch.
    safe = torch.where(normaliser != 0, normaliser, torch.ones_like(normaliser))
    return numerator / safe
