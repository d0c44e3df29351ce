"""RLHF math as pure tensor functions: masked statistics (``masked``), KL penalties and their coefficient
controllers (``kl``), GAE (``advantages``), group advantages (``group``), the surrogate and loss aggregation
(``surrogate``), the registry of policy losses (``policy_losses``), log-probs, entropies and value errors
(``losses``), the importance-sampling correction of another engine's rollouts (``rollout_correction``), DPO-family
(``dpo``), KTO (``kto``) and Bradley-Terry (``preference``) losses, and pass@k and maj@k (``pass_at_k``). No model, no
Lightning: each is checked number by number in tests."""

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
