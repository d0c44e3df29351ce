"""REINFORCE++ (Hu 2025), as OpenRLHF 0.11's ``reinforce`` and ``reinforce_baseline`` estimators.

No critic and, by default, no group: the KL penalty is shaped into every token's reward (the score on the last
token), the advantage of a token is its return-to-go, and advantages are whitened over the whole batch's valid
tokens, which stands in for a baseline (``advantages: WhitenedReturns``). Its ``baseline: group``
(REINFORCE++-baseline) first subtracts the mean score of the prompt's group.

The whitening is OpenRLHF's, number for number: (A - mean) / sqrt(max(var, 1e-8)) with the biased variance over
every valid token of the batch (every rank's). OpenRLHF also clamps each per-token KL estimate to [-10, 10]; here
that is ``kl.clamp: 10``, off by default (the unclamped estimator is the unbiased one).
"""

from __future__ import annotations

from typing import Any

from rlhf_lightning.algorithms.advantage_estimators import AdvantageEstimator, WhitenedReturns
from rlhf_lightning.algorithms.kl import KLPenalty
from rlhf_lightning.core.policy_gradient import PolicyGradient


class REINFORCEPlusPlus(PolicyGradient):
    """REINFORCE++: per-token KL-shaped rewards, return-to-go, batch-whitened advantages.

    Args:
        advantages: the advantage estimator (``WhitenedReturns``: ``baseline`` ``none`` (REINFORCE++) or ``group``
            (REINFORCE++-baseline: score minus the group's mean score; needs ``samples_per_prompt`` >= 2),
            ``gamma``, the discount of the return-to-go), or another registered one.
        kl: the KL penalty (``default_kl``: k1, per token in the reward, coefficient 0.01).
    """

    metric_prefix = "reinforce_pp"
    default_kl = KLPenalty(coef=0.01)

    def __init__(self, *args: Any, advantages: AdvantageEstimator = WhitenedReturns(),  # noqa: B008 (never mutated)
                 kl: KLPenalty = default_kl, **kwargs: Any) -> None:
        super().__init__(*args, kl=kl, **kwargs)
        self.advantages = self.keep_estimator(advantages)
