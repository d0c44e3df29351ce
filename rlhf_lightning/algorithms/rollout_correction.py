"""Importance-sampling correction of rollouts whose log-probs came from another engine than the trainer's pass.

The sampler (a captured decode kernel, another precision, an inference engine, a stale policy) and the trainer
can give the same tokens different probabilities; the policy gradient then estimates the trainer's objective
from another distribution's samples. The correction weights each token's policy loss by
w = pi_trainer / pi_sampler, truncated (TIS) or with the tokens or responses outside the bounds masked out (MIS),
as TRL 1.16's ``vllm_importance_sampling_mode`` does: ``token_truncate``, ``token_mask``, ``sequence_truncate``,
``sequence_mask`` with ``vllm_importance_sampling_clip_min`` / ``_clip_max`` (3.0 by default).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from rlhf_lightning.algorithms.kl import kl_penalty
from rlhf_lightning.algorithms.masked import masked_mean

RolloutCorrection = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
CORRECTIONS: tuple[str, ...] = get_args(RolloutCorrection)


def weight_dtype(trainer_logprobs: Tensor, sampler_logprobs: Tensor) -> torch.dtype:
    """The dtype the correction is computed in: the log-probs' own (float64 log-probs give float64 weights, as TRL's
    lines compute them), never below float32 (exp of a bfloat16 difference would keep 3 significant digits)."""
    return torch.promote_types(torch.promote_types(trainer_logprobs.dtype, sampler_logprobs.dtype), torch.float32)


def correction_weights(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, mode: RolloutCorrection,
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
