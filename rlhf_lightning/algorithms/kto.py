"""KTO (Ethayarajh et al. 2024): each response is labelled desirable or undesirable on its own, no pairs.

A response's implied reward is ``r = log pi(y|x) - log pi_ref(y|x)`` (summed over its tokens). Its value is
measured against a reference point ``z_ref``, the KL from the policy to the reference, estimated on mismatched
``(x, y')`` pairs of the same batch and held out of the gradient:

    desirable:    lambda_D * (1 - sigmoid(beta * (r - z_ref)))
    undesirable:  lambda_U * (1 - sigmoid(beta * (z_ref - r)))

averaged over the batch's examples (TRL 1.16's ``KTOTrainer``, ``loss_type: kto``: eqn. 7 of the paper, its
``nanmean`` over the concatenated losses). ``apo_zero_unpaired`` is the unpaired APO-zero loss (D'Oosterlinck et
al. 2024) TRL offers beside it: ``1 - sigmoid(beta * r)`` for desirable, ``sigmoid(beta * r)`` for undesirable
responses, no reference point.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from rlhf_lightning.algorithms.masked import SumOverRanks, masked_mean

KTOLossType = Literal["kto", "apo_zero_unpaired"]


class KTOOutput(NamedTuple):
    """Per-example losses ``[B]`` (weights applied) and implied rewards ``beta * r`` ``[B]`` (detached)."""

    losses: Tensor
    rewards: Tensor


def kto_reference_point(mismatched_logps: Tensor, ref_mismatched_logps: Tensor,
                        over_ranks: SumOverRanks | None = None) -> Tensor:
    """KTO's ``z_ref`` from one batch: the mean of ``log pi(y'|x) - log pi_ref(y'|x)`` over mismatched pairs,
    detached and clamped at 0 (a KL is never negative; TRL clamps the same way, after averaging over ranks).

    ``over_ranks`` sums a tensor over the ranks of a distributed run (None: one process), so that the mean is over
    every rank's rows (TRL averages the ranks' means: the same number when the ranks hold equal shares).
    """
    log_ratios = (mismatched_logps - ref_mismatched_logps).detach()
    every_row = torch.ones_like(log_ratios, dtype=torch.bool)
    return masked_mean(log_ratios, every_row, over_ranks=over_ranks).clamp(min=0)


def kto_loss(logps: Tensor, ref_logps: Tensor, desirable: Tensor, reference_point: Tensor, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             loss_type: KTOLossType = "kto") -> KTOOutput:
    """KTO's per-example losses.

    Args:
        logps, ref_logps: ``[B]`` summed log-probs of each response under the policy and the reference.
        desirable: ``[B]`` bool, the label of each response.
        reference_point: scalar ``z_ref`` (:func:`kto_reference_point`); unused by ``apo_zero_unpaired``.
        beta: inverse temperature (TRL's 0.1).
        desirable_weight, undesirable_weight: lambda_D and lambda_U.
    """
    log_ratio = logps - ref_logps
    if loss_type == "kto":
        desirable_loss = 1 - torch.sigmoid(beta * (log_ratio - reference_point))
        undesirable_loss = 1 - torch.sigmoid(beta * (reference_point - log_ratio))
    elif loss_type == "apo_zero_unpaired":
        desirable_loss = 1 - torch.sigmoid(beta * log_ratio)
        undesirable_loss = torch.sigmoid(beta * log_ratio)
    else:
        raise ValueError(f"loss_type {loss_type!r}: expected 'kto' or 'apo_zero_unpaired'")
    losses = torch.where(desirable, desirable_weight * desirable_loss, undesirable_weight * undesirable_loss)
    return KTOOutput(losses, beta * log_ratio.detach())


def recommended_weights(desirable: int, undesirable: int, desirable_weight: float,
                        undesirable_weight: float) -> str | None:
    """TRL's balance check (eqn. 8 of the KTO paper): with unequal counts, ``lambda_D * n_D / (lambda_U * n_U)``
    should lie in [1, 4/3]. Returns a line saying which weights would do, or None when they already do (or the
    counts are equal, where TRL does not check)."""
    ratio = desirable_weight * desirable / max(undesirable_weight * undesirable, 1e-12)
    if desirable == undesirable or 1.0 <= ratio <= 4 / 3 or not desirable or not undesirable:
        return None
    low_d = undesirable * undesirable_weight / desirable
    low_u = desirable * desirable_weight / undesirable
    return (f"{desirable} desirable and {undesirable} undesirable examples at desirable_weight={desirable_weight}, "
            f"undesirable_weight={undesirable_weight}: lambda_D n_D / (lambda_U n_U) = {ratio:.2f}, outside the "
            f"KTO paper's [1, 4/3]; set desirable_weight in [{low_d:.2f}, {low_d * 4 / 3:.2f}] or undesirable_weight "
            f"in [{low_u * 3 / 4:.2f}, {low_u:.2f}]")


def one_label_only(desirable: int, undesirable: int, source: str) -> str | None:
    """A line for training data whose responses all carry one label (``source`` names the data), or None.

    The loss is still defined and has a gradient (each response's log-ratio against the reference point), so such
    data trains; but it can only raise (or only lower) the likelihood of the responses it has, and nothing tells the
    policy what to avoid (or what to prefer): a labelling or filtering mistake more often than an intent. TRL
    1.16 warns too, with weight advice computed from a count of 1 for the missing label.
    """
    if (desirable and undesirable) or desirable + undesirable == 0:
        return None
    label, other = ("desirable", "undesirable") if desirable else ("undesirable", "desirable")
    effect = "raise" if desirable else "lower"
    return (f"all {desirable + undesirable} training examples of {source} are {label} (0 {other}): the loss can "
            f"only {effect} their likelihood against the reference point, and nothing shows the policy "
            f"{'what to avoid' if desirable else 'what to prefer'}; kto/rewards/margin is never logged. Add "
            f"{other} examples (label: {str(not desirable).lower()}), or give preference pairs, which split into both")
