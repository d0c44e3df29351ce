"""GRPO (Shao et al. 2024, DeepSeekMath) and its fixes as options: Dr. GRPO (Liu et al. 2025), DAPO (Yu et al.
2025), GSPO (Zheng et al. 2025).

No critic: each response's advantage is its reward against the other responses to the same prompt. The KL to
the reference goes into the loss (k3), with coefficient 0 by default, which skips the reference pass entirely.

| variant | options |
|---|---|
| GRPO (DeepSeekMath) | ``scale_rewards: group``, ``loss_aggregation: sequence_mean``, ``kl.coef: 0.04`` |
| Dr. GRPO | ``scale_rewards: none``, ``loss_aggregation: constant`` |
| DAPO | ``policy_loss.clip_range_high: 0.28``, ``loss_aggregation: token_mean``, ``mask_truncated_completions: true`` |
| GSPO | ``policy_loss.ratio_level: sequence`` (with its small clip ranges, e.g. 3e-4 / 4e-4) |
| CISPO | ``policy_loss: CISPO`` |
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlhf_lightning.algorithms.group import (
    ScaleRewards,
    broadcast_to_tokens,
    group_advantages,
    zero_std_fraction,
)
from rlhf_lightning.algorithms.kl import KLPenalty
from rlhf_lightning.algorithms.surrogate import LossAggregation
from rlhf_lightning.core.collect import Stats
from rlhf_lightning.core.experience import Experience, ShapedRewards
from rlhf_lightning.core.policy_gradient import PolicyGradient
from rlhf_lightning.utils import checks


class GRPO(PolicyGradient):
    """Group Relative Policy Optimization: advantages from groups of ``samples_per_prompt`` responses.

    Args:
        samples_per_prompt: responses per prompt (the group).
        scale_rewards: divide each advantage by the ``group``'s reward std (GRPO), the whole ``batch``'s, or
            ``none`` (Dr. GRPO: the std division favours prompts that are too easy or too hard).
        std_eps: added to the std before dividing (TRL's 1e-4).
        kl: the KL penalty (``default_kl``: beta 0 as TRL's default = no reference pass at all, the k3 estimator
            as GRPO, in the ``loss``; ``added_to: reward`` subtracts each response's sequence KL from its reward).
        loss_aggregation: ``token_mean`` (DAPO, TRL's default), ``sequence_mean`` (original GRPO) or
            ``constant`` (Dr. GRPO).
    """

    metric_prefix = "grpo"
    default_kl = KLPenalty(coef=0.0, estimator="k3", added_to="loss")

    def __init__(
        self,
        *args: Any,
        samples_per_prompt: int = 8,
        scale_rewards: ScaleRewards = "group",
        std_eps: float = 1e-4,
        kl: KLPenalty = default_kl,
        loss_aggregation: LossAggregation = "token_mean",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, samples_per_prompt=samples_per_prompt, kl=kl, loss_aggregation=loss_aggregation,
                         **kwargs)
        checks.one_of("scale_rewards", scale_rewards, ("group", "batch", "none"))
        checks.non_negative("std_eps", std_eps)
        if samples_per_prompt < 2:
            raise ValueError(f"GRPO needs samples_per_prompt >= 2 (a group of one has zero advantage), got "
                             f"{samples_per_prompt}")

    def estimate_advantages(self, experience: Experience, rewards: ShapedRewards) -> tuple[Experience, Stats]:
        """``(r - mean_group r) / (std + eps)`` (or unscaled), broadcast over each response's tokens; with the KL in
        the reward, ``r = score - kl.coef * KL(sequence)``."""
        hp = self.hparams
        sequence_rewards = rewards.sequence_rewards()
        advantages = group_advantages(sequence_rewards, experience.group_size, hp.scale_rewards, hp.std_eps,
                                      over_ranks=self.ranks.sum)
        stats = {"objective/frac_zero_std": zero_std_fraction(sequence_rewards, experience.group_size),
                 "objective/advantage_abs": advantages.abs().mean()}
        advantages = broadcast_to_tokens(advantages, experience.response_mask)
        return dataclasses.replace(experience, advantages=advantages), stats
