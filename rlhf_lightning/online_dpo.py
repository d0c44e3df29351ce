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
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.algorithms.dpo import DPOLossType, check_dpo_arguments, dpo_loss
from rlhf_lightning.algorithms.kl import kl_penalty
from rlhf_lightning.algorithms.masked import masked_mean
from rlhf_lightning.core.online import OnlineRL, Stats
from rlhf_lightning.core.policy import POLICY
from rlhf_lightning.rollout.experience import Experience
from rlhf_lightning.timing import phase
from rlhf_lightning.utils import checks


class OnlineDPO(OnlineRL):
    """DPO on the policy's own samples, two per prompt, ranked by the reward sources.

    A pair whose two scores are equal is a tie and carries no loss (TRL takes the first sample as chosen
    there); ``online_dpo/objective/tie_frac`` counts them and ``online_dpo/objective/scores_margin`` is the judge's
    mean score gap between chosen and rejected (ties included, at 0). The loss of an optimizer step is the mean
    over its untied pairs (of every rank). ``ipo`` uses the per-token averaged log-ratios of our DPO (TRL's online
    trainer sums them). Implicit rewards, accuracy and log-probs are logged as DPO's (``rewards/*``,
    ``logps/*``).

    Args:
        beta: inverse temperature of the implicit reward (TRL's 0.1).
        loss_type: any DPO loss: ``sigmoid`` (TRL's default), ``robust``, ``ipo``, ``hinge``, ``sigmoid_norm`` or
            ``simpo``.
        label_smoothing: probability that a judgement is wrong (cDPO / robust / SimPO), in [0, 0.5).
        simpo_gamma: SimPO's target margin.
        samples_per_prompt: must be 2: each prompt's two samples are its pair.
        kl_coef: must be 0: beta is what holds the policy near the reference (the KL is logged all the same).
    """

    metric_prefix = "online_dpo"
    measure_kl = True  # the loss needs the reference's log-probs anyway
    rows_kept_together = 2

    def __init__(self, *args: Any, beta: float = 0.1, loss_type: DPOLossType = "sigmoid",
                 label_smoothing: float = 0.0, simpo_gamma: float = 0.5, samples_per_prompt: int = 2,
                 kl_coef: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, samples_per_prompt=samples_per_prompt, kl_coef=kl_coef, **kwargs)
        check_dpo_arguments(beta, loss_type, label_smoothing)
        checks.non_negative("simpo_gamma", simpo_gamma)
        if samples_per_prompt != 2:
            raise ValueError(f"samples_per_prompt={samples_per_prompt}: online DPO samples exactly 2 responses per "
                             "prompt, its pair (for more per prompt, use GRPO or RLOO)")
        hp = self.hparams
        unused = {"kl_coef": (kl_coef, 0.0), "kl_target": (hp.kl_target, None), "ent_coef": (hp.ent_coef, 0.0),
                  "ptx_coef": (hp.ptx_coef, 0.0), "policy_loss": (hp.policy_loss, "clip"),
                  "rollout_correction": (hp.rollout_correction, "none")}
        for name, (value, default) in unused.items():
            if value != default:
                raise ValueError(f"{name}={value!r}: online DPO's loss is the DPO loss alone (beta holds the policy "
                                 f"near the reference); leave {name} at {default!r}")

    # ---- 2. the pairs -------------------------------------------------------------------------------------

    def estimate_advantages(self, experience: Experience, kl_coef: float) -> tuple[Experience, Stats]:
        """Each pair ordered chosen first (the higher score), ties marked with weight 0."""
        scores = experience.scores.view(-1, 2)
        second_wins = scores[:, 1] > scores[:, 0]
        first = torch.arange(0, scores.shape[0] * 2, 2, device=scores.device) + second_wins.long()
        order = torch.stack([first, first ^ 1], 1).flatten()  # the other row of the pair: flip the lowest bit
        tie = scores[:, 0] == scores[:, 1]
        experience = experience.select(order)
        experience = dataclasses.replace(experience, pair_weights=(~tie).float().repeat_interleave(2))
        chosen, rejected = experience.scores.view(-1, 2).unbind(1)
        return experience, {"objective/scores_margin": (chosen - rejected).mean(),
                            "objective/tie_frac": tie.float().mean()}

    # ---- 3. the loss --------------------------------------------------------------------------------------

    def step_normalisers(self, micros: list[Experience]) -> dict[str, Tensor]:
        """The step's untied pairs (mean over ranks, as DDP averages gradients)."""
        pairs = sum(micro.pair_weights[0::2].sum() for micro in micros)
        return {"policy": self.mean_over_ranks(pairs.float()).clamp(min=1.0)}

    def policy_losses(self, micro: Experience, normaliser: Tensor, ptx: dict[str, Tensor] | None,
                      kl_coef: float) -> tuple[Tensor, Stats]:
        """``(the micro-batch's share of the step's mean DPO loss over untied pairs, its terms)``."""
        hp = self.hparams
        mask = micro.response_mask
        with phase("update/policy forward"):
            logprobs, _ = self.response_logprobs(POLICY, micro.input_ids, micro.attention_mask, mask)
        summed = torch.where(mask, logprobs, 0.0).sum(-1)
        reference = torch.where(mask, micro.ref_logprobs, 0.0).sum(-1)
        lengths = mask.sum(-1)
        out = dpo_loss(summed[0::2], summed[1::2], reference[0::2], reference[1::2], lengths[0::2], lengths[1::2],
                       hp.beta, hp.loss_type, hp.label_smoothing, hp.simpo_gamma)
        weights = micro.pair_weights[0::2]
        old_logprobs = logprobs.detach() if micro.logprobs is None else micro.logprobs
        # How far the policy has moved from the sampling policy (k3 of KL(pi_old || pi)), for target_kl and logs.
        terms: Stats = {"policy/approx_kl": masked_mean(kl_penalty(old_logprobs, logprobs.detach(), "k3"), mask)}
        margin = out.chosen_rewards - out.rejected_rewards
        pair_values = {"rewards/chosen": out.chosen_rewards, "rewards/rejected": out.rejected_rewards,
                       "rewards/margin": margin, "rewards/accuracy": (margin > 0).float(),
                       "logps/chosen": summed[0::2].detach(), "logps/rejected": summed[1::2].detach()}
        # Means over the untied pairs (0 when every pair is a tie: every rank logs the same names).
        terms |= {name: masked_mean(value, weights) for name, value in pair_values.items()}
        loss = (out.losses * weights).sum() / normaliser
        terms["loss/policy"] = loss
        return loss, terms
