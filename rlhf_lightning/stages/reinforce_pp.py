"""REINFORCE++ (Hu 2025), as OpenRLHF 0.11's ``reinforce`` and ``reinforce_baseline`` estimators.

No critic and, by default, no group: the KL penalty is shaped into every token's reward (the score on the last
token), the advantage of a token is its return-to-go, and advantages are whitened over the whole batch's valid
tokens, which stands in for a baseline. ``baseline: group`` (REINFORCE++-baseline) first subtracts the mean score
of the prompt's group.

The whitening is OpenRLHF's, number for number: (A - mean) / sqrt(max(var, 1e-8)) with the biased variance over
every valid token of the batch (every rank's). OpenRLHF also clamps each per-token KL estimate to [-10, 10]; here
that is ``kl.clamp: 10``, off by default (the unclamped estimator is the unbiased one).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from rlhf_lightning.algorithms import masked_whiten
from rlhf_lightning.algorithms.group import group_advantages, returns_to_go
from rlhf_lightning.algorithms.kl import KLPenalty
from rlhf_lightning.core.collect import Stats
from rlhf_lightning.core.experience import Experience, ShapedRewards
from rlhf_lightning.core.policy_gradient import PolicyGradient
from rlhf_lightning.utils import checks


class REINFORCEPlusPlus(PolicyGradient):
    """REINFORCE++: per-token KL-shaped rewards, return-to-go, batch-whitened advantages.

    Args:
        baseline: ``none`` (REINFORCE++) or ``group`` (REINFORCE++-baseline: score minus the group's mean score;
            needs ``samples_per_prompt`` >= 2).
        gamma: discount of the return-to-go.
        kl: the KL penalty (``default_kl``: k1, per token in the reward, coefficient 0.01).
    """

    metric_prefix = "reinforce_pp"
    default_kl = KLPenalty(coef=0.01)

    def __init__(self, *args: Any, baseline: Literal["none", "group"] = "none", gamma: float = 1.0,
                 kl: KLPenalty = default_kl, **kwargs: Any) -> None:
        super().__init__(*args, kl=kl, **kwargs)
        checks.one_of("baseline", baseline, ("none", "group"))
        checks.in_range("gamma", gamma, 0.0, 1.0)
        if baseline == "group" and self.hparams.samples_per_prompt < 2:
            raise ValueError(f"baseline: group needs samples_per_prompt >= 2, got {self.hparams.samples_per_prompt}")

    def estimate_advantages(self, experience: Experience, rewards: ShapedRewards) -> tuple[Experience, Stats]:
        """Whitened return-to-go of ``-kl.coef * KL_t`` on every token plus the (baselined) score on the last (and
        an episode's turn rewards at the ends of their turns)."""
        mask = experience.response_mask
        scores = rewards.scores
        if self.hparams.baseline == "group":
            scores = group_advantages(rewards.total_scores, experience.group_size, "none")
            rewards = dataclasses.replace(rewards, dense=None)  # the group's baseline covers the turns' rewards
        token_rewards = rewards.token_rewards(scores)
        stats = {"objective/rlhf_reward": token_rewards.where(mask, 0.0).sum(-1).mean()}
        # Whitened over the global batch (every rank's tokens), which stands in for a baseline; OpenRLHF's biased
        # variance and floor.
        advantages = masked_whiten(returns_to_go(token_rewards, mask, self.hparams.gamma), mask,
                                   over_ranks=self.ranks.sum, unbiased=False, floor=True)
        return dataclasses.replace(experience, advantages=advantages), stats
