"""Advantage estimators: a registry, like the policy losses, each with its arguments as one typed group.

An estimator maps one :class:`AdvantageInput` (the rollout's :class:`ShapedRewards`, its group size and, for GAE,
the critic's values) and the cross-rank sum it is given (the loop's; the identity on one process) to
``(advantages [B, R], statistics, returns)``. Every statistic that pools the batch (a whitening's mean and variance,
the batch std of ``scale_rewards: batch``) is taken over every rank's rollout through that sum, so an estimator of
your own gets the global batch by using it.

A module names its estimator as ``advantages`` in a config, by class name or import path::

    advantages: {scale_rewards: none}                 # the module's own estimator, one field changed (Dr. GRPO)
    advantages:                                       # another one, with arguments
      class_path: LeaveOneOut
      init_args: {whiten_advantages: true}

Defining a subclass of :class:`AdvantageEstimator` registers it (a name we ship is refused).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple, get_args

import torch
from torch import Tensor

from rlhf_lightning.algorithms.advantages import gae
from rlhf_lightning.algorithms.group import (
    ScaleRewards,
    broadcast_to_tokens,
    group_advantages,
    normalize_advantages,
    returns_to_go,
    rloo_advantages,
    zero_std_fraction,
)
from rlhf_lightning.algorithms.masked import SumOverRanks, masked_whiten
from rlhf_lightning.algorithms.registered import Registered
from rlhf_lightning.algorithms.shaped_rewards import ShapedRewards
from rlhf_lightning.utils import checks


@dataclass(frozen=True)
class AdvantageInput:
    """What an estimator sees of one rollout: its shaped rewards (scores, the per-token KL and its coefficient in
    the rewards, an episode's turn rewards), how many consecutive responses share a prompt, and the critic's
    values ``[B, R]`` where there is one (PPO)."""

    rewards: ShapedRewards
    group_size: int
    values: Tensor | None = None

    @property
    def mask(self) -> Tensor:
        """``[B, R]`` the policy's tokens."""
        return self.rewards.mask


class AdvantageOutput(NamedTuple):
    """Advantages ``[B, R]`` (0 off the policy's tokens), statistics (scalars, logged as ``<prefix>/<name>``) and,
    for a critic, the returns ``[B, R]`` its value loss targets."""

    advantages: Tensor
    statistics: dict[str, Tensor]
    returns: Tensor | None = None


class AdvantageEstimator(Registered):
    """Base of the advantage estimators. Subclass it, take the estimator's arguments in ``__init__`` (checked
    there, one line each) and define ``__call__``; set ``needs_values`` when it reads a critic's values and
    ``needs_groups`` (why) when it compares a response with the others to its prompt."""

    registry: ClassVar[dict[str, type[AdvantageEstimator]]] = {}
    family = "advantage estimator"
    needs_values: ClassVar[bool] = False
    needs_groups: ClassVar[str | None] = None  # why two responses per prompt at least are needed; None: they are not

    def check_group(self, samples_per_prompt: int, owner: str) -> None:
        """Refuse, in one line, a group size the estimator cannot work with (``owner``: the module's name)."""
        if self.needs_groups is not None and samples_per_prompt < 2:
            raise ValueError(f"{owner} needs samples_per_prompt >= 2 ({self.needs_groups}), got {samples_per_prompt}")

    def __call__(self, inputs: AdvantageInput, sum_over_ranks: SumOverRanks) -> AdvantageOutput:
        """The advantages of ``inputs``; every batch statistic summed over ranks with ``sum_over_ranks``."""
        raise NotImplementedError


class GAE(AdvantageEstimator):
    """Generalised advantage estimation (Schulman et al. 2016) of the per-token rewards (``-kl.coef * KL_t`` on
    every token, the score on the last, an episode's turn rewards at the ends of their turns) against a critic's
    values; PPO's.

    Args:
        gamma: discount factor.
        lam: GAE lambda.
        whiten_rewards: scale per-token rewards to unit variance (mean kept) before GAE.
        whiten_advantages: standardise advantages over the valid tokens of the rollout batch.
    """

    needs_values = True

    def __init__(self, gamma: float = 1.0, lam: float = 0.95, whiten_rewards: bool = False,
                 whiten_advantages: bool = True) -> None:
        checks.in_range("advantages.gamma", gamma, 0.0, 1.0)
        checks.in_range("advantages.lam", lam, 0.0, 1.0)
        self.gamma = gamma
        self.lam = lam
        self.whiten_rewards = whiten_rewards
        self.whiten_advantages = whiten_advantages

    def __call__(self, inputs: AdvantageInput, sum_over_ranks: SumOverRanks) -> AdvantageOutput:
        rewards, mask = inputs.rewards, inputs.mask
        if inputs.values is None:
            raise ValueError("GAE needs the critic's values (PPO's rollout measures them)")
        token_rewards = rewards.token_rewards()
        stats = {"objective/kl_penalty": rewards.kl_or_zero.sum(-1).mean(),
                 "objective/rlhf_reward": torch.where(mask, token_rewards, 0.0).sum(-1).mean()}  # score - coef * KL
        if self.whiten_rewards:  # over the global batch (every rank's tokens)
            token_rewards = masked_whiten(token_rewards, mask, shift_mean=False, over_ranks=sum_over_ranks)
        advantages, returns = gae(token_rewards, inputs.values, mask, self.gamma, self.lam)
        if self.whiten_advantages:
            advantages = masked_whiten(advantages, mask, over_ranks=sum_over_ranks)
        return AdvantageOutput(advantages, stats, returns)


class GroupRelative(AdvantageEstimator):
    """GRPO's (Shao et al. 2024): each response's reward (``r = score - kl.coef * KL(sequence)`` with the KL in
    the reward) less its group's mean, over the std, broadcast over its tokens.

    Args:
        scale_rewards: divide each advantage by the ``group``'s reward std (GRPO), the whole ``batch``'s (every
            rank's), or ``none`` (Dr. GRPO: the std division favours prompts that are too easy or too hard).
        std_eps: added to the std before dividing (TRL's 1e-4).
    """

    needs_groups = "a group of one has zero advantage"

    def __init__(self, scale_rewards: ScaleRewards = "group", std_eps: float = 1e-4) -> None:
        checks.one_of("advantages.scale_rewards", scale_rewards, get_args(ScaleRewards))
        checks.non_negative("advantages.std_eps", std_eps)
        self.scale_rewards = scale_rewards
        self.std_eps = std_eps

    def __call__(self, inputs: AdvantageInput, sum_over_ranks: SumOverRanks) -> AdvantageOutput:
        sequence_rewards = inputs.rewards.sequence_rewards()
        advantages = group_advantages(sequence_rewards, inputs.group_size, self.scale_rewards, self.std_eps,
                                      over_ranks=sum_over_ranks)
        stats = {"objective/frac_zero_std": zero_std_fraction(sequence_rewards, inputs.group_size),
                 "objective/advantage_abs": advantages.abs().mean()}
        return AdvantageOutput(broadcast_to_tokens(advantages, inputs.mask), stats)


class LeaveOneOut(AdvantageEstimator):
    """RLOO's (Kool et al. 2019; Ahmadian et al. 2024; TRL's RLOOTrainer): ``r_i - mean_{j != i} r_j`` with
    ``r = score - kl.coef * KL(sequence)``, broadcast over each response's tokens.

    Args:
        whiten_advantages: standardise the advantages over the batch's responses (every rank's) as TRL's
            ``normalize_advantages``: (A - mean) / (std + 1e-4), Bessel's std.
    """

    needs_groups = "the baseline leaves one out"

    def __init__(self, whiten_advantages: bool = False) -> None:
        self.whiten_advantages = whiten_advantages

    def __call__(self, inputs: AdvantageInput, sum_over_ranks: SumOverRanks) -> AdvantageOutput:
        sequence_rewards = inputs.rewards.sequence_rewards()
        stats: dict[str, Tensor] = {}
        if inputs.rewards.kl_coef:
            stats["objective/rlhf_reward"] = sequence_rewards.mean()
        advantages = rloo_advantages(sequence_rewards, inputs.group_size)
        if self.whiten_advantages:  # over the responses, one value each (not over their tokens)
            advantages = normalize_advantages(advantages, over_ranks=sum_over_ranks)
        stats["objective/frac_zero_std"] = zero_std_fraction(sequence_rewards, inputs.group_size)
        return AdvantageOutput(broadcast_to_tokens(advantages, inputs.mask), stats)


class WhitenedReturns(AdvantageEstimator):
    """REINFORCE++'s (Hu 2025; OpenRLHF 0.11's ``reinforce`` and ``reinforce_baseline``): the return-to-go of
    ``-kl.coef * KL_t`` on every token plus the score on the last (and an episode's turn rewards at the ends of
    their turns), whitened over every valid token of the batch (every rank's), which stands in for a baseline:
    OpenRLHF's (A - mean) / sqrt(max(var, 1e-8)) with the biased variance.

    Args:
        baseline: ``none`` (REINFORCE++) or ``group`` (REINFORCE++-baseline: the score less its group's mean
            score; needs ``samples_per_prompt`` >= 2).
        gamma: discount of the return-to-go.
    """

    def __init__(self, baseline: Literal["none", "group"] = "none", gamma: float = 1.0) -> None:
        checks.one_of("advantages.baseline", baseline, ("none", "group"))
        checks.in_range("advantages.gamma", gamma, 0.0, 1.0)
        self.baseline = baseline
        self.gamma = gamma

    def check_group(self, samples_per_prompt: int, owner: str) -> None:
        if self.baseline == "group" and samples_per_prompt < 2:
            raise ValueError(f"advantages.baseline: group needs samples_per_prompt >= 2, got {samples_per_prompt}")

    def __call__(self, inputs: AdvantageInput, sum_over_ranks: SumOverRanks) -> AdvantageOutput:
        rewards, mask = inputs.rewards, inputs.mask
        scores = rewards.scores
        if self.baseline == "group":
            scores = group_advantages(rewards.total_scores, inputs.group_size, "none")
            rewards = dataclasses.replace(rewards, dense=None)  # the group's baseline covers the turns' rewards
        token_rewards = rewards.token_rewards(scores)
        stats = {"objective/rlhf_reward": token_rewards.where(mask, 0.0).sum(-1).mean()}
        advantages = masked_whiten(returns_to_go(token_rewards, mask, self.gamma), mask,
                                   over_ranks=sum_over_ranks, unbiased=False, floor=True)
        return AdvantageOutput(advantages, stats)
