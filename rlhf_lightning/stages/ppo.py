"""PPO with a critic on the shared base (Schulman et al. 2017; Ziegler et al. 2019; Ouyang et al. 2022).

The on-policy loop is :class:`~rlhf_lightning.core.online.OnlineRL`'s, its loss
:class:`~rlhf_lightning.core.policy_gradient.PolicyGradient`'s; PPO adds the critic (a LoRA adapter and a value head
on the same base: its values in the rollout, its clipped value loss in the update), and its advantages are GAE of
the rewards shaped per token with the KL penalty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from rlhf_lightning.algorithms import explained_variance, masked_mean, value_errors
from rlhf_lightning.algorithms.advantage_estimators import GAE, AdvantageInput
from rlhf_lightning.algorithms.shaped_rewards import ShapedRewards
from rlhf_lightning.algorithms.surrogate import aggregate_loss, loss_normaliser
from rlhf_lightning.core.collect import Stats
from rlhf_lightning.core.experience import Experience
from rlhf_lightning.core.micro_batches import UpdateSettings
from rlhf_lightning.core.pass_plan import PassSettings
from rlhf_lightning.core.policy import POLICY, without_dropout
from rlhf_lightning.core.policy_gradient import PolicyGradient
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import LoraSpec
from rlhf_lightning.utils import checks
from rlhf_lightning.utils.timing import phase

CRITIC = "critic"


@dataclass(frozen=True)
class CriticExperience(Experience):
    """The loop's experience with the critic's values and, after GAE, the returns its loss targets."""

    values: Tensor | None = None  # [B, R] values of the state before each response token, 0 after the end
    returns: Tensor | None = None  # [B, R]


@dataclass(frozen=True)
class Critic:
    """PPO's critic, the ``critic`` argument: a LoRA adapter and a linear value head on the shared base, its value
    loss and how it is trained. A config sets some fields and keeps the others' defaults
    (``critic: {lr: 1.0e-3}``); so does a dict of fields from Python (``PPO(critic={"lr": 1e-3}, ...)``).

    Args:
        lora: the critic adapter (its dropout is forced to 0; its value head is a plain linear layer).
        from_reward: start the critic from the reward adapter and head (the same LoRA shape needed; an ensemble's
            first member's).
        lr: learning rate of the critic adapter and value head.
        vf_coef: weight of the value loss.
        clip_range_value: clipping of value predictions around the rollout's; null = unclipped.
        backward: ``separate`` backpropagates the policy loss before the critic's forward pass, so the two graphs
            are never held together (less peak memory, same gradients); ``joint`` runs one backward for both, which
            DDP's reducer needs; ``auto`` = separate on one device, joint when distributed.
    """

    lora: LoraSpec = dataclasses.field(default_factory=LoraSpec)
    from_reward: bool = False
    lr: float = 1e-4
    vf_coef: float = 0.1
    clip_range_value: float | None = 0.2
    backward: Literal["auto", "joint", "separate"] = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.lora, Mapping):  # a dict of its fields, from Python (a config's is parsed already)
            object.__setattr__(self, "lora", LoraSpec(**self.lora))

    def check(self, name: str = "critic") -> Critic:
        """Raise a one-line error naming ``name.field`` for a value out of range."""
        checks.one_of(f"{name}.backward", self.backward, ("auto", "joint", "separate"))
        checks.positive(f"{name}.lr", self.lr)
        checks.non_negative(f"{name}.vf_coef", self.vf_coef)
        checks.non_negative(f"{name}.clip_range_value", self.clip_range_value, optional=True)
        self.lora.check(f"{name}.lora")
        return self


class PPO(PolicyGradient):
    """Proximal Policy Optimization of a causal LM against a reward, with one frozen base.

    The policy and the critic are LoRA adapters on the base (the SFT model); the reference is the same base
    with adapters disabled; the reward model is by default the reward stage's adapter on it too. Each response
    token gets ``-kl.coef * KL_t``, its last token the score; GAE turns these into advantages, whitened over the
    rollout; ``update.epochs`` passes of clipped policy and value losses follow.

    Args:
        critic: the critic (see :class:`Critic`: ``lora``, ``from_reward``, ``lr``, ``vf_coef``,
            ``clip_range_value``, ``backward``).
        update: how the policy and the critic train on each rollout (``default_update``: 4 ``epochs``; see
            :class:`~rlhf_lightning.core.micro_batches.UpdateSettings`).
        advantages: GAE against the critic's values (``gamma``, ``lam``, ``whiten_rewards``,
            ``whiten_advantages``: see :class:`~rlhf_lightning.algorithms.advantage_estimators.GAE`), or a subclass
            of it of your own.
    """

    metric_prefix = "ppo"
    dense_step_rewards = True  # a process reward model's step scores at their steps' last tokens, credited by GAE
    exported_roles = (POLICY, CRITIC)

    default_critic = Critic()  # the ``critic`` a dict of some of its fields is taken over
    default_update = UpdateSettings(epochs=4)  # the ``update`` likewise

    def __init__(
        self,
        *args: Any,
        critic: Critic = default_critic,
        update: UpdateSettings = default_update,
        advantages: GAE = GAE(),  # noqa: B008 (never mutated; the CLI shows it as the default)
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, update=update, **kwargs)
        self.advantages = self.keep_estimator(advantages, values=True)
        settings = self.keep_group("critic", critic, self.default_critic)
        self.critic = dataclasses.replace(settings, lora=without_dropout(settings.lora, CRITIC))
        if self.critic.from_reward and not any(source.adapter_role for source in self.rewards.sources):
            raise ValueError("critic.from_reward needs an AdapterReward or an EnsembleReward: the critic copies its "
                             "adapter and head (an ensemble's first member's)")

    def build_model(self, empty: bool) -> SharedBase:
        model = super().build_model(empty)
        model.add_adapter(CRITIC, self.critic.lora)
        model.add_head(CRITIC)
        if self.critic.from_reward:
            model.copy_adapter(next(s.adapter_role for s in self.rewards.sources if s.adapter_role), CRITIC)
        return model

    def pass_settings(self) -> PassSettings:
        """The reference pass at every ``kl.coef``, 0 included: ``ppo/objective/kl`` and ``objective/kl_penalty``
        are logged whatever the coefficient (the over-optimisation study's β = 0 runs)."""
        return dataclasses.replace(super().pass_settings(), measure_kl=True)

    # ---- the critic ---------------------------------------------------------------------------------------

    STEP_LOSSES = PolicyGradient.STEP_LOSSES | {"loss/value"}

    def response_values(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> Tensor:
        """Critic values ``[B, R]`` of the states before each response token."""
        return self.model.heads[CRITIC](self.policy.response_hidden_states(CRITIC, input_ids, attention_mask,
                                                                    response_mask))

    @torch.no_grad()
    def extend_experience(self, experience: Experience) -> CriticExperience:
        """The critic's values ``[B, R]`` of the rollout (0 after each response's end)."""
        mask = experience.response_mask
        with phase("rollout/values"):
            values = self.response_values(experience.input_ids, experience.attention_mask, mask)
        return experience.extended(CriticExperience, values=torch.where(mask, values, 0.0))

    def step_normalisers(self, micros: Sequence[Experience]) -> dict[str, Tensor]:
        """The policy's denominator and the value loss's: the step's response tokens (a token mean)."""
        tokens = sum(loss_normaliser(m.response_mask, "token_mean") for m in micros)
        return {**super().step_normalisers(micros), "tokens": self.ranks.mean(tokens.float()).clamp(min=1e-8)}

    def critic_losses(self, micro: Experience, normaliser: Tensor) -> tuple[Tensor, Stats]:
        """``(critic.vf_coef x clipped value loss, its terms)``, a token mean over the optimizer step."""
        mask = micro.response_mask
        with phase("update/critic forward"):
            values = self.response_values(micro.input_ids, micro.attention_mask, mask)
        errors, clipped = value_errors(values, micro.values, micro.returns, mask, self.critic.clip_range_value)
        loss = aggregate_loss(errors, mask, "token_mean", normaliser)
        return self.critic.vf_coef * loss, {"loss/value": loss, "value/clipfrac": masked_mean(clipped.float(), mask)}

    def loss(self, micro: CriticExperience, normalisers: dict[str, Tensor],
             ptx: dict[str, Tensor] | None) -> tuple[Tensor, Stats]:
        """The policy's terms and the critic's; the loss is their sum."""
        policy_total, terms = self.policy_losses(micro, normalisers["policy"], ptx)
        critic_total, critic_terms = self.critic_losses(micro, normalisers["tokens"])
        return policy_total + critic_total, {**terms, **critic_terms}

    def micro_step(self, micro: CriticExperience, normalisers: dict[str, Tensor],
                   ptx: dict[str, Tensor] | None) -> Stats:
        """Policy and critic losses of one micro-batch, backpropagated together or one after the other."""
        if self.joint_backward:
            return super().micro_step(micro, normalisers, ptx)
        # The policy graph is freed by its backward before the critic's forward pass builds the next one.
        policy_total, terms = self.policy_losses(micro, normalisers["policy"], ptx)
        self.manual_backward(policy_total)
        critic_total, critic_terms = self.critic_losses(micro, normalisers["tokens"])
        self.manual_backward(critic_total)
        return {**terms, **critic_terms, "loss/total": policy_total.detach() + critic_total.detach()}

    @property
    def joint_backward(self) -> bool:
        """One backward for the policy and critic losses (``backward``; ``auto``: joint under DDP, whose reducer
        needs every gradient in one pass)."""
        if self.critic.backward == "auto":
            return self.ranks.distributed
        return self.critic.backward == "joint"

    def parameter_groups(self) -> list[dict[str, Any]]:
        return [*super().parameter_groups(),
                {"name": CRITIC, "params": self.model.adapter_parameters(CRITIC), "lr": self.critic.lr}]

    # ---- advantages ---------------------------------------------------------------------------------------

    def advantage_input(self, experience: CriticExperience, rewards: ShapedRewards) -> AdvantageInput:
        return AdvantageInput(rewards, experience.group_size, experience.values)

    def estimate_advantages(self, experience: CriticExperience, rewards: ShapedRewards
                            ) -> tuple[Experience, Stats]:
        """GAE advantages and returns ``[B, R]`` of the per-token rewards (``-kl.coef * KL_t`` on every token, the
        score on the last, an episode's turn rewards at the ends of their turns), and the critic's diagnostics."""
        mask = experience.response_mask
        advantages, stats, returns = self.advantages(self.advantage_input(experience, rewards), self.ranks.sum)
        stats["value/explained_variance"] = explained_variance(experience.values, returns, mask)
        stats["value/mean"] = masked_mean(experience.values, mask)
        return dataclasses.replace(experience, advantages=advantages, returns=returns), stats
