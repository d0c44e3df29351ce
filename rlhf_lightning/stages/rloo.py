"""RLOO: REINFORCE with a leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024), TRL's RLOOTrainer's
advantages.

Each response's reward is its score minus ``kl.coef`` times its sequence KL to the reference (k1); its advantage
is that reward minus the mean reward of the other responses to the same prompt (``advantages: LeaveOneOut``); its
``whiten_advantages`` is TRL's ``normalize_advantages``, (A - mean) / (std + 1e-4) over the batch's responses.

The loss. TRL 1.16's RLOOTrainer clips one ratio per response, the exponential of its summed log-ratio, and averages
over responses: ``policy_loss.ratio_level: sequence_sum`` with ``loss.aggregation: sequence_mean`` here, number for
number. The default is the family's instead, a ratio per token and the token mean over the step (as GRPO, PPO and
REINFORCE++ here): the two are identical on the first optimizer step of a rollout, and on the later ones (the shipped
config makes four: two epochs of two minibatches) a per-token clip bounds each token's update, where a product of 30
token ratios leaves the clip range after small moves of each and silences whole responses.
"""

from __future__ import annotations

from typing import Any

from rlhf_lightning.algorithms.advantage_estimators import AdvantageEstimator, LeaveOneOut
from rlhf_lightning.algorithms.kl import KLPenalty
from rlhf_lightning.core.policy_gradient import PolicyGradient


class RLOO(PolicyGradient):
    """REINFORCE Leave-One-Out: a critic-free baseline from the other ``samples_per_prompt - 1`` responses.

    Args:
        samples_per_prompt: responses per prompt (at least 2: the baseline leaves one out).
        advantages: the advantage estimator (``LeaveOneOut``: ``whiten_advantages``, standardise the advantages
            over the batch's responses as TRL's ``normalize_advantages``), or another registered one.
        kl: the KL penalty (``default_kl``: coefficient 0.05 of the sequence KL, the k1 estimate summed over the
            response as TRL, subtracted from each reward).
    """

    metric_prefix = "rloo"
    default_kl = KLPenalty(coef=0.05)

    def __init__(self, *args: Any, samples_per_prompt: int = 4, kl: KLPenalty = default_kl,
                 advantages: AdvantageEstimator = LeaveOneOut(), **kwargs: Any) -> None:  # noqa: B008 (never mutated)
        super().__init__(*args, samples_per_prompt=samples_per_prompt, kl=kl, **kwargs)
        self.advantages = self.keep_estimator(advantages)
