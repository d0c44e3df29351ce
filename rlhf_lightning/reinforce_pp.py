"""REINFORCE++ (Hu 2025), as OpenRLHF 0.11's ``reinforce`` and ``reinforce_baseline`` estimators.

No critic and, by default, no group: the KL penalty is shaped into every token's reward (the score on the last
token), the advantage of a token is its return-to-go, and advantages are whitened over the whole batch's valid
tokens, which stands in for a baseline. ``baseline: group`` (REINFORCE++-baseline) first subtracts the mean score
of the prompt's group.

The whitening is OpenRLHF's, number for number: (A - mean) / sqrt(max(var, 1e-8)) with the biased variance over
every valid token of the batch (every rank's). OpenRLHF also clamps each per-token KL estimate to [-10, 10]; here
that is ``kl_clamp: 10``, off by default (the unclamped estimator is the unbiased one).
"""

from __future__ import annotations

from typing import Any, Literal

from rlhf_lightning.algorithms import kl_penalty, masked_whiten, token_rewards
from rlhf_lightning.algorithms.group import group_advantages, returns_to_go
from rlhf_lightning.core.online import OnlineRL, Stats
from rlhf_lightning.rollout.experience import Experience
from rlhf_lightning.utils import checks


class REINFORCEPlusPlus(OnlineRL):
    """REINFORCE++: per-token KL-shaped rewards, return-to-go, batch-whitened advantages.

    Args:
        baseline: ``none`` (REINFORCE++) or ``group`` (REINFORCE++-baseline: score minus the group's mean score;
            needs ``samples_per_prompt`` >= 2).
        gamma: discount of the return-to-go.
        kl_coef: coefficient of the per-token KL penalty in the reward.
    """

    metric_prefix = "reinforce_pp"

    def __init__(self, *args: Any, baseline: Literal["none", "group"] = "none", gamma: float = 1.0,
                 kl_coef: float = 0.01, **kwargs: Any) -> None:
        super().__init__(*args, kl_coef=kl_coef, **kwargs)
        checks.one_of("baseline", baseline, ("none", "group"))
        checks.in_range("gamma", gamma, 0.0, 1.0)
        if baseline == "group" and self.hparams.samples_per_prompt < 2:
            raise ValueError(f"baseline: group needs samples_per_prompt >= 2, got {self.hparams.samples_per_prompt}")

    def estimate_advantages(self, experience: Experience, kl_coef: float) -> tuple[Experience, Stats]:
        """Whitened return-to-go of ``-kl_coef * KL_t`` on every token plus the (baselined) score on the last."""
        hp = self.hparams
        mask = experience.response_mask
        scores = experience.scores
        if hp.baseline == "group":
            scores = group_advantages(scores, experience.group_size, "none")
        kl = (kl_penalty(experience.logprobs, experience.ref_logprobs, hp.kl_estimator, hp.kl_clamp) if kl_coef
              else mask.float() * 0.0)
        rewards = token_rewards(scores, kl, mask, kl_coef)
        stats = {"objective/rlhf_reward": rewards.where(mask, 0.0).sum(-1).mean()}
        # Whitened over the global batch (every rank's tokens), which stands in for a baseline; OpenRLHF's biased
        # variance and floor.
        advantages = masked_whiten(returns_to_go(rewards, mask, self.hparams.gamma), mask,
                                   over_ranks=self.sum_over_ranks, unbiased=False, floor=True)
        return experience.with_advantages(advantages), stats
