"""RLHF math as pure tensor functions: masked statistics, KL penalties, GAE, PPO and Bradley-Terry losses."""

from __future__ import annotations

from rlhf_lightning.algorithms.advantages import gae
from rlhf_lightning.algorithms.head import logprobs_from_hidden
from rlhf_lightning.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    kl_penalty,
    token_rewards,
)
from rlhf_lightning.algorithms.losses import (
    PolicyLossOutput,
    ValueLossOutput,
    entropy_from_logits,
    explained_variance,
    logprobs_from_logits,
    policy_loss,
    value_errors,
    value_loss,
)
from rlhf_lightning.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlhf_lightning.algorithms.preference import bradley_terry_loss

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KLEstimator",
    "PolicyLossOutput",
    "ValueLossOutput",
    "bradley_terry_loss",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "kl_penalty",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "token_rewards",
    "value_errors",
    "value_loss",
]
