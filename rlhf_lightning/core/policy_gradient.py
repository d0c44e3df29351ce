"""Policy-gradient algorithms on the on-policy loop: a registered policy loss, the KL penalty to the reference, the
entropy bonus and PPO-ptx.

The loss of a micro-batch is built around the registered loss (:mod:`rlhf_lightning.algorithms.policy_losses`),
each piece applied once: the policy's log-probs, the loss's per-token terms (with the importance-sampling
correction of the sampler's log-probs, ``correction``, in the loss's input), ``+ kl.coef x`` the per-token KL (in
the loss, GRPO's way; or shaped into the rewards before the advantages, PPO's), ``- loss.ent_coef x`` the entropy,
aggregated over the optimizer step (``loss.aggregation``), ``+ loss.ptx_coef x`` the pretraining loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_lightning.algorithms import (
    kl_penalty,
    masked_mean,
)
from rlhf_lightning.algorithms.advantage_estimators import AdvantageEstimator, AdvantageInput
from rlhf_lightning.algorithms.kl import KLPenalty
from rlhf_lightning.algorithms.loss_settings import LossSettings
from rlhf_lightning.algorithms.policy_losses import Clip, PolicyLoss, PolicyLossInput
from rlhf_lightning.algorithms.rollout_correction import RolloutCorrection, mismatch_statistics
from rlhf_lightning.algorithms.shaped_rewards import ShapedRewards
from rlhf_lightning.algorithms.surrogate import (
    aggregate_loss,
    log_importance_ratio,
    loss_normaliser,
)
from rlhf_lightning.core.collect import Stats
from rlhf_lightning.core.experience import Experience, FirstPass, sampling_statistics
from rlhf_lightning.core.online import OnlineRL
from rlhf_lightning.core.pass_plan import PassSettings
from rlhf_lightning.core.policy import POLICY
from rlhf_lightning.data.collate import IGNORE_INDEX
from rlhf_lightning.models.loading import check_positions
from rlhf_lightning.utils import checks
from rlhf_lightning.utils.timing import Stopwatch, phase


class PolicyGradient(OnlineRL):
    """The on-policy loop with a policy-gradient loss: subclasses take an ``advantages`` argument (a registered
    :class:`~rlhf_lightning.algorithms.advantage_estimators.AdvantageEstimator`, kept with :meth:`keep_estimator`) or
    define :meth:`estimate_advantages`.

    Args:
        policy_loss: the registered policy loss and its arguments: ``Clip`` (PPO's clipped surrogate:
            ``clip_range``, ``clip_range_high``, ``ratio_level``, ``clip_against``) or ``CISPO`` (``max_weight``,
            ``min_weight``, ``ratio_level``, ``clip_against``), or a
            :class:`~rlhf_lightning.algorithms.policy_losses.PolicyLoss` of your own by import path.
        loss: how the per-token terms become the loss, and what is added to it: ``aggregation`` (``token_mean``,
            ``sequence_mean``, ``constant``), ``mask_truncated_completions``, ``ent_coef``, ``ptx_coef`` (see
            :class:`~rlhf_lightning.algorithms.loss_settings.LossSettings`); each algorithm's defaults in
            ``default_loss``.
        kl: the KL penalty to the reference (``coef``, ``estimator``, ``clamp``, ``added_to``, ``ratio_weighting``,
            ``target``, ``horizon``: see :class:`~rlhf_lightning.algorithms.kl.KLPenalty`); each algorithm has its
            own defaults (``default_kl``), which a config's fields override one by one.
        correction: importance-sampling correction of the sampler's log-probs against the trainer's (another
            precision or kernel, a stale policy): ``mode`` (``token_truncate``, ``token_mask``,
            ``sequence_truncate``, ``sequence_mask``: TRL 1.16's names; ``none`` = off), ``min_weight``,
            ``max_weight`` (see :class:`~rlhf_lightning.algorithms.rollout_correction.RolloutCorrection`). Its
            weights reach the policy loss in its input; with the loss's ``clip_against: proximal`` this is AReaL's
            decoupled objective for stale rollouts (``asynchronous.max_staleness``). The mismatch is logged either way
            (``rollout/mismatch_kl``).
    """

    default_kl = KLPenalty()  # the k1 estimate shaped into the rewards with coefficient 0.05
    default_loss = LossSettings()  # the ``loss`` a dict of some of its fields is taken over
    advantages: AdvantageEstimator | None = None  # the subclass's ``advantages`` argument (keep_estimator)

    def __init__(
        self,
        *args: Any,
        policy_loss: PolicyLoss = Clip(),  # noqa: B008 (never mutated; the CLI shows it as the default)
        loss: LossSettings = default_loss,
        kl: KLPenalty = default_kl,
        correction: RolloutCorrection = RolloutCorrection(),  # noqa: B008 (frozen; the CLI shows it as the default)
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        PolicyLoss.require("policy_loss", policy_loss)
        self.loss_settings: LossSettings = self.keep_group("loss", loss, self.default_loss)
        self.kl: KLPenalty = self.keep_group("kl", kl, self.default_kl)
        self.correction: RolloutCorrection = self.keep_group("correction", correction, RolloutCorrection())
        if policy_loss.clip_against == "sampler" and self.correction.mode != "none":
            raise ValueError(f"policy_loss.clip_against: sampler with correction.mode: {self.correction.mode}: the "
                             "ratio is already against the sampler, so the correction would weigh it twice; set one "
                             "of them")
        if self.loss_settings.mask_truncated_completions and checks.optional_str(self.sampling.stop_token) is None:
            raise ValueError("loss.mask_truncated_completions needs a sampling.stop_token: without one no response "
                             "ever stops, so every response would be masked and nothing would train")
        self.policy_loss = policy_loss
        self.kl_controller = self.kl.controller()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        datamodule = self.datamodule
        ptx = getattr(datamodule, "ptx", None)
        if ptx is not None and ptx.train_set is not None:
            check_positions(self.base_spec, self.tokenizer, ptx.longest(), "the longest pretraining (ptx) example",
                            "lower data.init_args.ptx_max_length (longer examples are then skipped)")

    @property
    def ptx_coef(self) -> float:
        return self.loss_settings.ptx_coef

    def pass_settings(self) -> PassSettings:
        """The loop's, with the KL penalty (``kl.added_to``; charged when the coefficient is > 0, or adaptive) and a loss
        that takes the first update pass made before the rewards."""
        return dataclasses.replace(super().pass_settings(), kl_in=self.kl.added_to, reusable_first_pass=True,
                                   kl_penalised=self.kl_controller.value > 0 or self.kl.target is not None)

    def kl_coef_in(self, place: Literal["reward", "loss"]) -> float:
        """The current KL coefficient if the KL penalty goes into ``place`` (``kl.added_to``), else 0."""
        return self.kl_controller.value if self.kl.added_to == place else 0.0

    def first_update_pass(self, experience: Experience) -> FirstPass:
        """The policy's forward pass of the first optimizer step on the whole rollout, with gradients (with the
        entropy, whose statistic it gives; its gradient under an entropy bonus)."""
        with phase("update/policy forward"):
            logprobs, entropy = self.policy.response_logprobs(POLICY, experience.input_ids, experience.attention_mask,
                                                       experience.response_mask, with_entropy=True,
                                                       entropy_grad=bool(self.loss_settings.ent_coef))
        return FirstPass(logprobs, entropy)

    # ---- 2. rewards, 3. advantages -------------------------------------------------------------------------

    def shape_rewards(self, experience: Experience) -> tuple[ShapedRewards, Stats]:
        """The loop's rewards with the per-token KL of the rollout (``kl.estimator``, ``kl.clamp``) and this
        iteration's coefficient of it in the rewards. The KL is computed as the plan says (``PassPlan.reward_kl``):
        when the rewards charge it, or the algorithm measures it (PPO logs it as ``objective/kl_penalty``)."""
        rewards, stats = super().shape_rewards(experience)
        kl = None
        if self.pass_plan.reward_kl:
            kl = torch.where(experience.response_mask, kl_penalty(experience.logprobs, experience.ref_logprobs,
                                                                  self.kl.estimator, self.kl.clamp), 0.0)
        stats["objective/kl_coef"] = torch.tensor(self.kl_controller.value)
        return dataclasses.replace(rewards, kl=kl, kl_coef=self.kl_coef_in("reward")), stats

    def prepare_update(self, experience: Experience, rewards: ShapedRewards) -> tuple[Experience, Stats]:
        return self.estimate_advantages(experience, rewards)

    def keep_estimator(self, estimator: AdvantageEstimator, values: bool = False) -> AdvantageEstimator:
        """The module's ``advantages`` argument checked against it (a registered estimator; a critic's values only
        where ``values``; a group size it can work with), to keep as :attr:`advantages`."""
        AdvantageEstimator.require("advantages", estimator)
        if estimator.needs_values and not values:
            raise ValueError(f"advantages: {type(estimator).__name__} needs a critic's values, and "
                             f"{type(self).__name__} has no critic (PPO has one)")
        estimator.check_group(self.hparams.samples_per_prompt, type(self).__name__)
        return estimator

    def advantage_input(self, experience: Experience, rewards: ShapedRewards) -> AdvantageInput:
        """What the estimator sees of the rollout: its shaped rewards and group size (a critic adds its values)."""
        return AdvantageInput(rewards, experience.group_size)

    def estimate_advantages(self, experience: Experience, rewards: ShapedRewards) -> tuple[Experience, Stats]:
        """The algorithm: the experience with its advantages ``[B, R]`` (and what else its loss reads), and
        statistics. ``rewards`` holds the scores, the per-token KL and its coefficient in the rewards. By default
        the module's :attr:`advantages` estimator (its ``advantages`` argument), given the sum over ranks."""
        if self.advantages is None:
            raise NotImplementedError(f"{type(self).__name__} names no advantage estimator: take an ``advantages`` "
                                      "argument (self.advantages = self.keep_estimator(advantages)) or define "
                                      "estimate_advantages")
        advantages, stats, _ = self.advantages(self.advantage_input(experience, rewards), self.ranks.sum)
        return dataclasses.replace(experience, advantages=advantages), stats

    # ---- 4. the loss --------------------------------------------------------------------------------------

    def loss_mask(self, experience: Experience) -> Tensor:
        """``[B, R]`` tokens that carry loss: the responses, less those that never stopped when
        ``loss.mask_truncated_completions`` is set."""
        if not self.loss_settings.mask_truncated_completions:
            return experience.response_mask
        return experience.response_mask & experience.is_stopped[:, None]

    def step_normalisers(self, micros: Sequence[Experience]) -> dict[str, Tensor]:
        """The policy loss's denominator over the step (``loss.aggregation`` of the tokens that carry loss)."""
        aggregation = self.loss_settings.aggregation
        policy = sum(loss_normaliser(self.loss_mask(m), aggregation, self.sampling.max_new_tokens) for m in micros)
        return {"policy": self.ranks.mean(policy.float()).clamp(min=1e-8)}

    def loss(self, micro: Experience, normalisers: dict[str, Tensor],
             ptx: dict[str, Tensor] | None) -> tuple[Tensor, Stats]:
        return self.policy_losses(micro, normalisers["policy"], ptx)

    def policy_losses(self, micro: Experience, normaliser: Tensor,
                      ptx: dict[str, Tensor] | None = None) -> tuple[Tensor, Stats]:
        """``(policy part of the loss, its terms)``: the registered loss, corrected for the sampler, + the KL term
        at this iteration's coefficient in the loss, - the entropy bonus, aggregated over the step
        (``normaliser``); + PPO-ptx."""
        settings = self.loss_settings
        mask, loss_mask = micro.response_mask, self.loss_mask(micro)
        own_pass = micro.logprobs is None  # its own pass gives the rollout's log-probs (PassPlan.logprobs_pass)
        if micro.first_pass is not None:
            logprobs, entropy = micro.first_pass.logprobs, micro.first_pass.entropy
        else:
            with phase("update/policy forward"):
                logprobs, entropy = self.policy.response_logprobs(
                    POLICY, micro.input_ids, micro.attention_mask, mask,
                    with_entropy=bool(settings.ent_coef) or own_pass, entropy_grad=bool(settings.ent_coef))
        # One optimizer step per rollout: the policy has not moved since sampling, so its own pass, detached,
        # gives the old log-probs (ratio 1 in value, the policy gradient in gradient).
        proximal = logprobs.detach() if own_pass else micro.logprobs
        # the trainer's log-probs at the update's start against the sampler's (another engine, or a stale policy)
        weights = self.correction.weights(proximal, micro.sampler_logprobs, mask)
        inputs = PolicyLossInput(logprobs, proximal, micro.sampler_logprobs, micro.advantages, mask,
                                 micro.ref_logprobs, weights)
        per_token, statistics = self.policy_loss(inputs)
        old_logprobs = inputs.anchor(self.policy_loss.clip_against)
        mismatch = mismatch_statistics(proximal, micro.sampler_logprobs, mask)
        terms: Stats = {f"rollout/mismatch_{name}": value for name, value in mismatch.items()}
        if weights is not None:
            terms["rollout/correction_weight"] = masked_mean(weights, mask)
            terms["rollout/corrected_out"] = masked_mean((weights == 0).float(), mask)
        log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0).detach()
        terms["policy/approx_kl"] = masked_mean(torch.expm1(log_ratio) - log_ratio, mask)
        terms |= {f"policy/{name}": value for name, value in statistics.items()}
        if own_pass:  # the statistics of the policy at sampling time, of this pass
            terms |= sampling_statistics(logprobs.detach(), entropy.detach(), micro.ref_logprobs, mask)[0]
        terms["loss/policy"] = aggregate_loss(per_token, loss_mask, settings.aggregation, normaliser)
        kl_coef = self.kl_coef_in("loss")
        if kl_coef > 0:
            # Padding gets the reference's own log-prob (KL 0 there): garbage could overflow k3's exp and turn
            # the masked-out zero gradient into NaN.
            kl = kl_penalty(torch.where(mask, logprobs, micro.ref_logprobs), micro.ref_logprobs, self.kl.estimator,
                            self.kl.clamp)
            if self.kl.ratio_weighting:  # by the loss's own ratio: per token, or per response (GSPO)
                kl = kl * torch.exp(log_importance_ratio(logprobs, old_logprobs, mask, self.policy_loss.ratio_level))
            per_token = per_token + kl_coef * kl
            terms["loss/kl"] = masked_mean(kl.detach(), mask)
        if settings.ent_coef:
            per_token = per_token - settings.ent_coef * entropy
            terms["loss/entropy"] = masked_mean(entropy.detach(), mask)
        total = aggregate_loss(per_token, loss_mask, settings.aggregation, normaliser)
        if settings.ptx_coef and ptx is not None:
            terms["loss/ptx"] = self.ptx_loss(ptx)
            total = total + settings.ptx_coef * terms["loss/ptx"]
        return total, terms

    def ptx_loss(self, batch: dict[str, Tensor]) -> Tensor:
        """Next-token loss of the policy on pretraining/SFT text (the PPO-ptx term of InstructGPT)."""
        with self.model.role(POLICY):
            logits = self.model.next_token_logits(batch["input_ids"], batch["attention_mask"]).float()
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX)

    # ---- 5. after the iteration ---------------------------------------------------------------------------

    def end_iteration(self, experience: Experience, stats: Stats, watch: Stopwatch) -> None:
        """The adaptive KL coefficient's update from this iteration's KL, then the loop's bookkeeping."""
        if "objective/kl" in stats:
            world_samples = experience.response_mask.shape[0] * (self.trainer.world_size if self._trainer else 1)
            self.kl_controller.update(float(self.ranks.mean(stats["objective/kl"])), world_samples)
        super().end_iteration(experience, stats, watch)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["kl_controller"] = self.kl_controller.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.kl_controller.load_state_dict(checkpoint["kl_controller"])
