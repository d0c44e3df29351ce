"""A rollout's rewards with the KL penalty to the reference: what every advantage estimator starts from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf_lightning.algorithms.kl import token_rewards


@dataclass(frozen=True)
class ShapedRewards:
    """A rollout's rewards with the KL penalty to the reference, made once per iteration (the loop's step 2) for the
    advantage estimator.

    ``kl`` is the rollout's per-token KL estimate (``kl.estimator`` of the log-probs at sampling time against the
    reference's, ``kl.clamp``-ed, 0 off the policy's tokens), computed once; ``kl_coef`` its coefficient in the
    rewards (0 when the KL goes into the loss, or when nothing penalises it). ``dense`` holds rewards placed at
    single tokens: an episode's environment rewards at the ends of its turns, and whatever a subclass adds
    (:meth:`with_dense`).
    """

    scores: Tensor  # [B] the reward sources' scores
    mask: Tensor  # [B, R] the policy's tokens
    kl: Tensor | None = None  # [B, R]; None without both log-prob passes
    kl_coef: float = 0.0
    dense: Tensor | None = None  # [B, R]

    def with_dense(self, rewards: Tensor) -> ShapedRewards:
        """These rewards plus ``rewards`` ``[B, R]`` at single tokens (e.g. a cost on every response token)."""
        return dataclasses.replace(self, dense=rewards if self.dense is None else self.dense + rewards)

    @property
    def total_scores(self) -> Tensor:
        """``[B]`` each response's score plus its dense rewards (an episode's environment rewards)."""
        return self.scores if self.dense is None else self.scores + self.dense.sum(-1)

    @property
    def kl_or_zero(self) -> Tensor:
        """``[B, R]`` the per-token KL, zeros without it."""
        return torch.zeros_like(self.mask, dtype=torch.float32) if self.kl is None else self.kl

    def sequence_rewards(self) -> Tensor:
        """``[B]`` each response's reward: its total score less ``kl_coef`` times its summed KL (GRPO, RLOO)."""
        if not self.kl_coef:
            return self.total_scores
        return self.total_scores - self.kl_coef * self.kl.sum(-1)

    def token_rewards(self, scores: Tensor | None = None) -> Tensor:
        """``[B, R]`` per-token rewards: ``-kl_coef * KL_t`` on every policy token, ``scores`` (the sources' unless
        given) at the last one, and the dense rewards where they are (PPO, REINFORCE++)."""
        rewards = token_rewards(self.scores if scores is None else scores, self.kl_or_zero, self.mask, self.kl_coef)
        return rewards if self.dense is None else rewards + self.dense
