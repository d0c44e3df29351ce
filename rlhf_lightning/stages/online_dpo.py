"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"; TRL's
``OnlineDPOTrainer``): DPO on pairs the current policy samples, ranked by the reward sources.

Each iteration samples two responses per prompt, scores both with the reward sources (a reward adapter on the
same base, a separate model or functions: the judge), takes the higher-scored one as chosen and trains any of
the DPO family's losses (:func:`~rlhf_lightning.algorithms.dpo.dpo_loss`) against the reference, the base with
adapters disabled. It runs on the on-policy loop: sampling, scoring, reference pass and update are the loop's;
this module only ranks and defines the loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.algorithms.dpo import check_beta, dpo_loss, pair_values
from rlhf_lightning.algorithms.kl import kl_penalty
from rlhf_lightning.algorithms.masked import masked_mean
from rlhf_lightning.algorithms.preference_losses import PreferenceLoss, Sigmoid
from rlhf_lightning.algorithms.shaped_rewards import ShapedRewards
from rlhf_lightning.core.collect import Stats
from rlhf_lightning.core.experience import Experience
from rlhf_lightning.core.online import OnlineRL
from rlhf_lightning.core.pass_plan import PassSettings
from rlhf_lightning.core.policy import POLICY
from rlhf_lightning.utils.timing import phase


@dataclass(frozen=True)
class PairExperience(Experience):
    """The loop's experience ordered in pairs, chosen then rejected, with each pair's weight."""

    pair_weights: Tensor | None = None  # [B] 1 on both rows of a pair that carries loss, 0 for a tie


class OnlineDPO(OnlineRL):
    """DPO on the policy's own samples, two per prompt, ranked by the reward sources.

    A pair whose two scores are equal is a tie and carries no loss (TRL takes the first sample as chosen
    there); ``online_dpo/objective/tie_frac`` counts them and ``online_dpo/objective/scores_margin`` is the judge's
    mean score gap between chosen and rejected (ties included, at 0). The loss of an optimizer step is the mean
    over its untied pairs (of every rank). ``IPO`` uses the per-token averaged log-ratios of our DPO (TRL's online
    trainer sums them). Implicit rewards, accuracy and log-probs are logged as DPO's (``rewards/*``,
    ``logps/*``). It takes none of the policy-gradient family's arguments (no surrogate, no KL penalty: beta holds
    the policy near the reference; the KL is logged all the same).

    Args:
        beta: inverse temperature of the implicit reward (TRL's 0.1).
        preference_loss: any registered DPO loss and its arguments: ``Sigmoid`` (TRL's default; its
            ``label_smoothing`` is the probability that a judgement is wrong), ``Robust``, ``IPO``, ``Hinge``,
            ``SigmoidNorm`` or ``SimPO`` (``gamma``), or a
            :class:`~rlhf_lightning.algorithms.preference_losses.PreferenceLoss` of your own by import path.
    """

    metric_prefix = "online_dpo"
    rows_kept_together = 2

    def __init__(self, *args: Any, beta: float = 0.1,
                 preference_loss: PreferenceLoss = Sigmoid(),  # noqa: B008 (never mutated)
                 **kwargs: Any) -> None:
        if "samples_per_prompt" in kwargs:
            raise ValueError(f"samples_per_prompt={kwargs['samples_per_prompt']}: online DPO samples exactly 2 "
                             "responses per prompt, its pair (for more per prompt, use GRPO or RLOO)")
        super().__init__(*args, samples_per_prompt=2, **kwargs)
        check_beta(beta)
        PreferenceLoss.require("preference_loss", preference_loss)
        self.preference_loss = preference_loss  # the instance (hparams hold what the config said)

    def pass_settings(self) -> PassSettings:
        """The reference pass always (the loss reads the reference's log-probs), and with it the rollout's own
        log-prob pass: the KL is logged, measured before the update."""
        return dataclasses.replace(super().pass_settings(), measure_kl=True)

    # ---- 3. the pairs -------------------------------------------------------------------------------------

    def prepare_update(self, experience: Experience, rewards: ShapedRewards) -> tuple[Experience, Stats]:
        """Each pair ordered chosen first (the higher score, an episode's turn rewards included), ties marked with
        weight 0."""
        scores = rewards.total_scores.view(-1, 2)
        second_wins = scores[:, 1] > scores[:, 0]
        first = torch.arange(0, scores.shape[0] * 2, 2, device=scores.device) + second_wins.long()
        order = torch.stack([first, first ^ 1], 1).flatten()  # the other row of the pair: flip the lowest bit
        tie = scores[:, 0] == scores[:, 1]
        pairs = experience.extended(PairExperience, pair_weights=(~tie).float().repeat_interleave(2)).select(order)
        chosen, rejected = scores.flatten()[order].view(-1, 2).unbind(1)
        return pairs, {"objective/scores_margin": (chosen - rejected).mean(),
                       "objective/tie_frac": tie.float().mean()}

    # ---- 4. the loss --------------------------------------------------------------------------------------

    def step_normalisers(self, micros: Sequence[PairExperience]) -> dict[str, Tensor]:
        """The step's untied pairs (mean over ranks, as DDP averages gradients)."""
        pairs = sum(micro.pair_weights[0::2].sum() for micro in micros)
        return {"policy": self.ranks.mean(pairs.float()).clamp(min=1.0)}

    def loss(self, micro: PairExperience, normalisers: dict[str, Tensor],
             ptx: dict[str, Tensor] | None) -> tuple[Tensor, Stats]:
        """``(the micro-batch's share of the step's mean DPO loss over untied pairs, its terms)``."""
        hp = self.hparams
        normaliser = normalisers["policy"]
        mask = micro.response_mask
        with phase("update/policy forward"):
            logprobs, _ = self.policy.response_logprobs(POLICY, micro.input_ids, micro.attention_mask, mask)
        summed = torch.where(mask, logprobs, 0.0).sum(-1)
        reference = torch.where(mask, micro.ref_logprobs, 0.0).sum(-1)
        lengths = mask.sum(-1)
        out = dpo_loss(summed[0::2], summed[1::2], reference[0::2], reference[1::2], lengths[0::2], lengths[1::2],
                       hp.beta, self.preference_loss)
        weights = micro.pair_weights[0::2]
        old_logprobs = logprobs.detach() if micro.logprobs is None else micro.logprobs
        # How far the policy has moved from the sampling policy (k3 of KL(pi_old || pi)), for target_kl and logs.
        terms: Stats = {"policy/approx_kl": masked_mean(kl_penalty(old_logprobs, logprobs.detach(), "k3"), mask)}
        # Means over the untied pairs (0 when every pair is a tie: every rank logs the same names).
        terms |= {name: masked_mean(value, weights)
                  for name, value in pair_values(out, summed[0::2], summed[1::2]).items()}
        loss = (out.losses * weights).sum() / normaliser
        terms["loss/policy"] = loss
        return loss, terms
