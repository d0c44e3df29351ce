"""RLHF math as pure tensor functions, no model and no Lightning, each checked number by number in tests: statistics
over unpadded entries (``masked``), the KL penalty and its controllers (``kl``), a rollout's rewards with the KL
penalty (``shaped_rewards``), GAE (``advantages``), the critic-free family's group advantages (``group``), the
registry of advantage estimators built on them (``advantage_estimators``), per-token log-probs, entropies and the
value error (``losses``), the clipped surrogate and loss aggregation (``surrogate``), the policy-gradient modules'
``loss`` group of settings (``loss_settings``), the registry of policy losses (``policy_losses``), importance-
sampling correction of another engine's log-probs (``rollout_correction``), the DPO family (``dpo``) and the
registry of its per-pair losses (``preference_losses``), the loss families behind both registries, whose members a
config names by class name (``registered``), KTO (``kto``), the Bradley-Terry loss (``preference``), how a reward-
model ensemble's members combine and which pairs each trains on (``ensemble``) and pass@k / maj@k (``pass_at_k``)."""

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
