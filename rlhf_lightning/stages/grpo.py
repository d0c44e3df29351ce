"""GRPO (Shao et al. 2024, DeepSeekMath) and its fixes as options: Dr. GRPO (Liu et al. 2025), DAPO (Yu et al.
2025), GSPO (Zheng et al. 2025).

No critic: each response's advantage is its reward against the other responses to the same prompt. The KL to
the reference goes into the loss (k3), with coefficient 0 by default, which skips the reference pass entirely.

| variant | options |
|---|---|
| GRPO (DeepSeekMath) | ``advantages.scale_rewards: group``, ``loss.aggregation: sequence_mean``, ``kl.coef: 0.04`` |
| Dr. GRPO | ``advantages.scale_rewards: none``, ``loss.aggregation: constant`` |
| DAPO | ``policy_loss.clip_range_high: 0.28``, ``loss: {aggregation: token_mean, mask_truncated_completions: true}`` |
| GSPO | ``policy_loss.ratio_level: sequence`` (with its small clip ranges, e.g. 3e-4 / 4e-4) |
| CISPO | ``policy_loss: CISPO`` |
"""

from __future__ import annotations

from typing import Any

from rlhf_lightning.algorithms.advantage_estimators import AdvantageEstimator, GroupRelative
from rlhf_lightning.algorithms.kl import KLPenalty
from rlhf_lightning.core.policy_gradient import PolicyGradient


class GRPO(PolicyGradient):
    """Group Relative Policy Optimization: advantages from groups of ``samples_per_prompt`` responses.

    Args:
        samples_per_prompt: responses per prompt (the group).
        advantages: the advantage estimator (``GroupRelative``: ``scale_rewards`` ``group`` (GRPO), ``batch`` or
            ``none`` (Dr. GRPO), ``std_eps``), or another registered one by name or import path (``LeaveOneOut``,
            ``WhitenedReturns``, one of your own).
        kl: the KL penalty (``default_kl``: beta 0 as TRL's default = no reference pass at all, the k3 estimator
            as GRPO, in the ``loss``; ``added_to: reward`` subtracts each response's sequence KL from its reward).
    """

    metric_prefix = "grpo"
    default_kl = KLPenalty(coef=0.0, estimator="k3", added_to="loss")

    def __init__(
        self,
        *args: Any,
        samples_per_prompt: int = 8,
        advantages: AdvantageEstimator = GroupRelative(),  # noqa: B008 (never mutated; the CLI shows it as the default)
        kl: KLPenalty = default_kl,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, samples_per_prompt=samples_per_prompt, kl=kl, **kwargs)
        self.advantages = self.keep_estimator(advantages)
