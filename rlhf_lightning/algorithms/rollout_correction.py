"""Importance-sampling correction of rollouts whose log-probs came from another engine than the trainer's pass.

The sampler (a captured decode kernel, another precision, an inference engine, a stale policy) and the trainer
can give the same tokens different probabilities; the policy gradient then estimates the trainer's objective
from another distribution's samples. The correction weights each token's policy loss by
w = pi_trainer / pi_sampler, truncated (TIS) or with the tokens or responses outside the bounds masked out (MIS),
as TRL 1.16's ``vllm_importance_sampling_mode`` does: ``token_truncate``, ``token_mask``, ``sequence_truncate``,
``sequence_mask`` with ``vllm_importance_sampling_clip_min`` / ``_clip_max`` (3.0 by default).

A module takes it as the ``correction`` group (:class:`RolloutCorrection`); the weights reach the policy loss in its
input (:class:`~rlhf_lightning.algorithms.policy_losses.PolicyLossInput`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from rlhf_lightning.algorithms.kl import kl_penalty
from rlhf_lightning.algorithms.masked import masked_mean
from rlhf_lightning.utils import checks

CorrectionMode = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
CORRECTIONS: tuple[str, ...] = get_args(CorrectionMode)


@dataclass(frozen=True)
class RolloutCorrection:
    """The ``correction`` argument: importance-sampling correction of the sampler's log-probs against the
    trainer's (another precision or kernel, a stale policy). Each token's policy loss is weighted by
    w = pi_trainer / pi_sampler per token or per response; the mismatch is logged either way
    (``rollout/mismatch_kl``). A config sets some fields and keeps the others' defaults
    (``correction: {mode: token_truncate}``).

    Args:
        mode: ``token_truncate`` / ``sequence_truncate`` clamp w to [``min_weight``, ``max_weight``] (TIS);
            ``token_mask`` / ``sequence_mask`` zero the tokens or responses outside it (MIS): TRL 1.16's
            ``vllm_importance_sampling_mode`` names; ``none`` = off.
        min_weight: lower bound of the weight; null = none. It must be below ``max_weight``.
        max_weight: upper bound of the weight (TRL's 3.0); null = none.
    """

    mode: CorrectionMode = "none"
    min_weight: float | None = None
    max_weight: float | None = 3.0

    def check(self, name: str = "correction") -> RolloutCorrection:
        """Raise a one-line error naming ``name.field`` for a value out of range or bounds that leave no weight."""
        checks.one_of(f"{name}.mode", self.mode, CORRECTIONS)
        checks.non_negative(f"{name}.min_weight", self.min_weight, optional=True)
        checks.positive(f"{name}.max_weight", self.max_weight, optional=True)
        if self.min_weight is not None and self.max_weight is not None and self.min_weight >= self.max_weight:
            # An empty range masks every token (*_mask) and a single point gives every token the same weight
            # (*_truncate): nothing would be corrected, and with a mask nothing would train.
            raise ValueError(f"{name}.min_weight={self.min_weight} is not below {name}.max_weight={self.max_weight}: "
                             "the correction keeps weights inside [min_weight, max_weight], so every token would be "
                             "masked out or get the same weight; set the minimum below the maximum (TRL's bounds: "
                             "none and 3.0)")
        return self

    def weights(self, trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor | None:
        """Detached weights ``[B, T]`` of each token's policy loss (:func:`correction_weights`); None when off."""
        if self.mode == "none":
            return None
        return correction_weights(trainer_logprobs, sampler_logprobs, mask, self.mode, self.min_weight,
                                  self.max_weight)


def weight_dtype(trainer_logprobs: Tensor, sampler_logprobs: Tensor) -> torch.dtype:
    """The dtype the correction is computed in: the log-probs' own (float64 log-probs give float64 weights, as TRL's
    lines compute them), never below float32 (exp of a bfloat16 difference would keep 3 significant digits)."""
    return torch.promote_types(torch.promote_types(trainer_logprobs.dtype, sampler_logprobs.dtype), torch.float32)


def correction_weights(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, mode: CorrectionMode,
                       clip_min: float | None = None, clip_max: float | None = 3.0) -> Tensor:
    """Detached weights ``[B, T]`` of each token's policy loss (1 everywhere with ``mode="none"``).

    As TRL 1.16 computes them: d = (lp_trainer - lp_sampler) on response tokens (0 elsewhere); token modes take
    w_t = exp(d_t), sequence modes one w = exp(sum_t d_t) per response on each of its tokens; ``*_truncate``
    clamps w to [clip_min, clip_max], ``*_mask`` sets w to 0 outside it (a missing bound is no bound). Computed in
    the log-probs' dtype, float32 at least (:func:`weight_dtype`).
    """
    if mode not in CORRECTIONS:
        raise ValueError(f"Unknown rollout correction {mode!r}; expected one of {', '.join(CORRECTIONS)}.")
    valid = mask.bool()
    dtype = weight_dtype(trainer_logprobs, sampler_logprobs)
    if mode == "none":
        return torch.ones_like(trainer_logprobs, dtype=dtype)
    difference = torch.where(valid, trainer_logprobs.detach().to(dtype) - sampler_logprobs.to(dtype), 0.0)
    if mode.startswith("sequence"):
        difference = difference.sum(-1, keepdim=True)
    weights = torch.exp(difference)
    if mode.endswith("truncate"):
        if clip_min is not None or clip_max is not None:
            weights = weights.clamp(min=clip_min, max=clip_max)
    else:
        low = -torch.inf if clip_min is None else clip_min
        high = torch.inf if clip_max is None else clip_max
        weights = weights.masked_fill((weights < low) | (weights > high), 0.0)
    return torch.where(valid, weights.expand_as(valid), 0.0)


def mismatch_statistics(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the sampler's log-probs are from the trainer's on the response tokens: ``kl`` (k3 estimate of
    KL(sampler || trainer) per token, on the sampler's own samples), ``logprob_diff_mean`` and
    ``logprob_diff_max`` (|lp_trainer - lp_sampler|, TRL's ``sampling_logp_difference``)."""
    valid = mask.bool()
    dtype = weight_dtype(trainer_logprobs, sampler_logprobs)
    trainer, sampler = trainer_logprobs.detach().to(dtype), sampler_logprobs.to(dtype)
    absolute = torch.where(valid, trainer - sampler, 0.0).abs()
    return {"kl": masked_mean(kl_penalty(sampler, trainer, "k3"), valid),
            "logprob_diff_mean": masked_mean(absolute, valid),
            "logprob_diff_max": absolute.max() if valid.any() else absolute.new_zeros(())}
