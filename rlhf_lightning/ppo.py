"""PPO with a critic on the shared base (Schulman et al. 2017; Ziegler et al. 2019; Ouyang et al. 2022).

The on-policy loop is :class:`~rlhf_lightning.core.online.OnlineRL`'s; PPO adds the critic (a LoRA adapter and a
value head on the same base), rewards shaped per token with the KL penalty, GAE and the clipped value loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from rlhf_lightning.algorithms import (
    explained_variance,
    gae,
    kl_penalty,
    masked_mean,
    masked_whiten,
    token_rewards,
    value_errors,
)
from rlhf_lightning.algorithms.surrogate import aggregate_loss, loss_normaliser
from rlhf_lightning.core.online import OnlineRL, Stats
from rlhf_lightning.core.policy import POLICY, without_dropout
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import LoraSpec
from rlhf_lightning.rollout.experience import Experience
from rlhf_lightning.rollout.rewards import REWARD_ROLE, AdapterReward
from rlhf_lightning.timing import phase
from rlhf_lightning.utils import checks

CRITIC = "critic"


class PPO(OnlineRL):
    """Proximal Policy Optimization of a causal LM against a reward, with one frozen base.

    The policy and the critic are LoRA adapters on the base (the SFT model); the reference is the same base
    with adapters disabled; the reward model is by default the reward stage's adapter on it too. Each response
    token gets ``-kl_coef * KL_t``, its last token the score; GAE turns these into advantages, whitened over the
    rollout; ``epochs`` passes of clipped policy and value losses follow.

    Args:
        critic_lora: the critic adapter (its value head is a plain linear layer).
        critic_from_reward: start the critic from the reward adapter and head (same LoRA shape needed).
        epochs: passes over each rollout batch.
        clip_range_value: clipping of value predictions around the rollout's; null = unclipped.
        vf_coef: weight of the value loss.
        whiten_rewards: scale per-token rewards to unit variance (mean kept) before GAE.
        gamma: discount factor.
        lam: GAE lambda.
        whiten_advantages: standardise advantages over the valid tokens of the rollout batch.
        critic_lr: learning rate of the critic adapter and value head.
        backward: ``separate`` backpropagates the policy loss before the critic's forward pass, so the two graphs
            are never held together (less peak memory, same gradients); ``joint`` runs one backward for both, which
            DDP's reducer needs; ``auto`` = separate on one device, joint when distributed.
    """

    metric_prefix = "ppo"
    measure_kl = True  # ppo/objective/kl at every kl_coef, 0 included (the over-optimisation study's β = 0 runs)
    exported_roles = (POLICY, CRITIC)

    def __init__(
        self,
        *args: Any,
        critic_lora: LoraSpec = LoraSpec(),  # noqa: B008 (never mutated; the CLI shows it as the default)
        critic_from_reward: bool = False,
        epochs: int = 4,
        clip_range_value: float | None = 0.2,
        vf_coef: float = 0.1,
        whiten_rewards: bool = False,
        gamma: float = 1.0,
        lam: float = 0.95,
        whiten_advantages: bool = True,
        critic_lr: float = 1e-4,
        backward: Literal["auto", "joint", "separate"] = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, epochs=epochs, **kwargs)
        checks.one_of("backward", backward, ("auto", "joint", "separate"))
        checks.in_range("gamma", gamma, 0.0, 1.0)
        checks.in_range("lam", lam, 0.0, 1.0)
        checks.positive("critic_lr", critic_lr)
        checks.non_negative("vf_coef", vf_coef)
        checks.non_negative("clip_range_value", clip_range_value, optional=True)
        if critic_from_reward and not any(isinstance(source, AdapterReward) for source in self.rewards.sources):
            raise ValueError("critic_from_reward needs an AdapterReward: the critic copies its adapter and head")
        self.critic_lora = without_dropout(critic_lora.check("critic_lora"), CRITIC)
        self.critic_from_reward = critic_from_reward

    def build_model(self, empty: bool) -> SharedBase:
        model = super().build_model(empty)
        model.add_adapter(CRITIC, self.critic_lora)
        model.add_head(CRITIC)
        if self.critic_from_reward:
            model.copy_adapter(REWARD_ROLE, CRITIC)
        return model

    # ---- the critic ---------------------------------------------------------------------------------------

    STEP_LOSSES = OnlineRL.STEP_LOSSES | {"loss/value"}

    def response_values(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> Tensor:
        """Critic values ``[B, R]`` of the states before each response token."""
        return self.model.heads[CRITIC](self.response_hidden_states(CRITIC, input_ids, attention_mask,
                                                                    response_mask))

    @torch.no_grad()
    def make_experience(self, prompts: dict[str, Any]) -> tuple[Experience, Stats]:
        """The loop's experience, with the critic's values ``[B, R]`` (0 after each response's end)."""
        experience, stats = super().make_experience(prompts)
        mask = experience.response_mask
        with phase("rollout/values"):
            values = self.response_values(experience.input_ids, experience.attention_mask, mask)
        return dataclasses.replace(experience, values=torch.where(mask, values, 0.0)), stats

    def step_normalisers(self, micros: Sequence[Experience]) -> dict[str, Tensor]:
        """The policy's denominator and the value loss's: the step's response tokens (a token mean)."""
        tokens = sum(loss_normaliser(m.response_mask, "token_mean") for m in micros)
        return {**super().step_normalisers(micros), "tokens": self.mean_over_ranks(tokens.float()).clamp(min=1e-8)}

    def critic_losses(self, micro: Experience, normaliser: Tensor) -> tuple[Tensor, Stats]:
        """``(vf_coef x clipped value loss, its terms)``, a token mean over the optimizer step."""
        hp = self.hparams
        mask = micro.response_mask
        with phase("update/critic forward"):
            values = self.response_values(micro.input_ids, micro.attention_mask, mask)
        errors, clipped = value_errors(values, micro.values, micro.returns, mask, hp.clip_range_value)
        loss = aggregate_loss(errors, mask, "token_mean", normaliser)
        return hp.vf_coef * loss, {"loss/value": loss, "value/clipfrac": masked_mean(clipped.float(), mask)}

    def losses(self, experience: Experience, ptx: dict[str, Tensor] | None = None,
               kl_coef: float | None = None) -> Stats:
        """The policy's terms and the critic's; ``loss/total`` is their sum."""
        terms = super().losses(experience, ptx, kl_coef)
        critic_total, critic_terms = self.critic_losses(experience, self.step_normalisers([experience])["tokens"])
        return {**terms, **critic_terms, "loss/total": terms["loss/total"] + critic_total}

    def micro_step(self, micro: Experience, normalisers: dict[str, Tensor], ptx: dict[str, Tensor] | None,
                   kl_coef: float) -> Stats:
        """Policy and critic losses of one micro-batch, backpropagated together or one after the other."""
        policy_total, terms = self.policy_losses(micro, normalisers["policy"], ptx, kl_coef)
        if self.joint_backward:
            critic_total, critic_terms = self.critic_losses(micro, normalisers["tokens"])
            self.manual_backward(policy_total + critic_total)
        else:
            # The policy graph is freed by its backward before the critic's forward pass builds the next one.
            self.manual_backward(policy_total)
            critic_total, critic_terms = self.critic_losses(micro, normalisers["tokens"])
            self.manual_backward(critic_total)
        return {**terms, **critic_terms, "loss/total": policy_total.detach() + critic_total.detach()}

    @property
    def joint_backward(self) -> bool:
        """One backward for the policy and critic losses (``backward``; ``auto``: joint under DDP, whose reducer
        needs every gradient in one pass)."""
        if self.hparams.backward == "auto":
            return self._trainer is not None and self.trainer.world_size > 1
        return self.hparams.backward == "joint"

    def parameter_groups(self) -> list[dict[str, Any]]:
        return [*super().parameter_groups(),
                {"name": CRITIC, "params": self.adapter_parameters(CRITIC), "lr": self.hparams.critic_lr}]

    # ---- rewards and advantages ---------------------------------------------------------------------------

    def shape_rewards(self, experience: Experience, kl_coef: float) -> tuple[Tensor, Tensor]:
        """Per-token rewards ``[B, R]`` (``-kl_coef * KL_t`` on every token, the score on the last; in an episode
        each turn's environment reward on that turn's last token, the rest of the score on the last) and the
        per-token KL ``[B, R]`` (``kl_estimator``; 0 without reference log-probs)."""
        hp = self.hparams
        kl = (torch.zeros_like(experience.response_mask, dtype=torch.float32) if experience.ref_logprobs is None
              else kl_penalty(experience.logprobs, experience.ref_logprobs, hp.kl_estimator, hp.kl_clamp))
        if experience.turn_rewards is None:
            return token_rewards(experience.scores, kl, experience.response_mask, kl_coef), kl
        final = experience.scores - experience.turn_rewards.sum(-1)  # scores hold the turns' rewards too
        return token_rewards(final, kl, experience.response_mask, kl_coef) + experience.turn_rewards, kl

    def estimate_advantages(self, experience: Experience, kl_coef: float) -> tuple[Experience, Stats]:
        """GAE advantages and returns ``[B, R]`` of the shaped rewards (``kl_coef``: the KL coefficient in them);
        advantages whitened over the batch's valid tokens."""
        hp = self.hparams
        mask = experience.response_mask
        rewards, kl = self.shape_rewards(experience, kl_coef)
        stats = {"objective/kl_penalty": torch.where(mask, kl, 0.0).sum(-1).mean(),
                 "objective/rlhf_reward": torch.where(mask, rewards, 0.0).sum(-1).mean()}  # score - coef * KL
        if hp.whiten_rewards:  # over the global batch (every rank's tokens)
            rewards = masked_whiten(rewards, mask, shift_mean=False, over_ranks=self.sum_over_ranks)
        advantages, returns = gae(rewards, experience.values, mask, hp.gamma, hp.lam)
        if hp.whiten_advantages:
            advantages = masked_whiten(advantages, mask, over_ranks=self.sum_over_ranks)
        stats["value/explained_variance"] = explained_variance(experience.values, returns, mask)
        stats["value/mean"] = masked_mean(experience.values, mask)
        return experience.with_advantages(advantages, returns), stats
