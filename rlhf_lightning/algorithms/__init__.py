"""RLHF math as pure tensor functions: masked statistics, KL penalties, GAE, group advantages, surrogate and value
errors, DPO-family and Bradley-Terry losses. No model, no Lightning: each is checked number by number in tests."""

from __future__ import annotations

from rlhf_lightning.algorithms.advantages import gae
from rlhf_lightning.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    kl_penalty,
    token_rewards,
)
from rlhf_lightning.algorithms.losses import (
    entropy_from_logits,
    explained_variance,
    logprobs_from_logits,
    value_errors,
)
from rlhf_lightning.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlhf_lightning.algorithms.preference import bradley_terry_loss

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KLEstimator",
    "bradley_terry_loss",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "token_rewards",
    "value_errors",
]
