"""Offline preference losses (DPO and its variants) from per-response log-probabilities.

Every input is one number per response: its log-probability summed over the response tokens (policy, and
the frozen reference for all but SimPO) and its token count. Each loss is returned per pair, ``[B]``; reducing
over the batch is left to the caller, so pair weights or masks can be applied first.

Notation: ``Delta_w = lp(y_w) - lp_ref(y_w)`` and ``Delta_l = lp(y_l) - lp_ref(y_l)`` are the log-ratios of
the chosen and rejected responses, ``Delta = Delta_w - Delta_l``; ``|y|`` is a response's token count. The losses
themselves are a registry (:mod:`rlhf_lightning.algorithms.preference_losses`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rlhf_lightning.algorithms.preference_losses import PreferenceLoss, Sigmoid


class DPOLossOutput(NamedTuple):
    """Per-pair preference loss (differentiable) and detached diagnostics, all ``[B]``.

    ``chosen_rewards`` / ``rejected_rewards`` are the implicit rewards ``beta * (lp - lp_ref)`` of the summed
    log-probs (TRL's ``rewards/chosen``), for every loss including IPO and ``SigmoidNorm``; for SimPO, which has
    no reference, they are ``beta * lp / |y|``.

    ``logits`` is the preference margin before ``beta``: the loss is a function of ``beta * logits`` for every
    loss except IPO, whose loss is ``(logits - 1 / (2 beta))^2``. Per loss:
    Sigmoid, Robust, Hinge: ``Delta``; IPO, SigmoidNorm: ``Delta_w / |y_w| - Delta_l / |y_l|``;
    SimPO: ``lp(y_w) / |y_w| - lp(y_l) / |y_l| - gamma / beta`` (TRL's CPO convention, so that
    ``beta * logits`` is the SimPO margin with gamma already subtracted).
    """

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    logits: Tensor


def _check_logps(name: str, logps: Tensor, like: Tensor) -> None:
    if logps.shape != like.shape:
        raise ValueError(
            f"{name} must have the shape of policy_chosen_logps {tuple(like.shape)}, "
            f"got {tuple(logps.shape)}."
        )


def _lengths(name: str, lengths: Tensor, like: Tensor) -> Tensor:
    """Token counts as ``like``'s dtype and device, refused unless all positive."""
    lengths = torch.as_tensor(lengths, device=like.device)
    if lengths.shape != like.shape:
        raise ValueError(f"{name} must have shape {tuple(like.shape)}, got {tuple(lengths.shape)}.")
    # This reads a value back from the device (a sync), but an empty response would otherwise show up only
    # later as an inf or NaN loss, far from its cause. `not (x > 0)` also catches NaN lengths.
    if not bool((lengths > 0).all()):
        raise ValueError(f"{name} must be positive (every response needs at least one token), got {lengths}.")
    return lengths.to(like.dtype)


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    beta: float = 0.1,
    loss: PreferenceLoss = Sigmoid(),  # noqa: B008 (never mutated)
) -> DPOLossOutput:
    """Per-pair offline preference loss ``loss`` (a :class:`~rlhf_lightning.algorithms.preference_losses.
    PreferenceLoss`: ``Sigmoid`` DPO, ``Robust``, ``IPO``, ``Hinge``, ``SigmoidNorm``, ``SimPO`` or one of your own);
    see :class:`DPOLossOutput` for the diagnostics returned with it.

    Shapes: every log-prob input ``[B]`` (summed over the response tokens), lengths ``[B]`` integer or float
    token counts, all positive. ``ref_*`` may be None only for a reference-free loss (SimPO), which ignores them.
    Returns ``[B]`` tensors.
    """
    check_beta(beta)
    if policy_chosen_logps.dim() != 1:
        raise ValueError(
            f"policy_chosen_logps must be 1-D [B], got shape {tuple(policy_chosen_logps.shape)}."
        )
    _check_logps("policy_rejected_logps", policy_rejected_logps, policy_chosen_logps)
    chosen_lengths = _lengths("chosen_lengths", chosen_lengths, policy_chosen_logps)
    rejected_lengths = _lengths("rejected_lengths", rejected_lengths, policy_chosen_logps)

    if loss.uses_reference:
        for name, reference in (("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
            if reference is None:
                raise ValueError(f"{name} is required for loss {loss.name!r} (only a reference-free loss such as "
                                 "SimPO goes without).")
            _check_logps(name, reference, policy_chosen_logps)
        chosen = policy_chosen_logps - ref_chosen_logps
        rejected = policy_rejected_logps - ref_rejected_logps
    else:
        chosen, rejected = policy_chosen_logps, policy_rejected_logps
    logits = loss.margin(chosen, rejected, chosen_lengths, rejected_lengths, beta)
    chosen_rewards, rejected_rewards = loss.implicit_rewards(chosen, rejected, chosen_lengths, rejected_lengths, beta)
    return DPOLossOutput(loss(logits, beta), chosen_rewards.detach(), rejected_rewards.detach(), logits.detach())


def check_beta(beta: float) -> None:
    """Refuse a ``beta`` that is not positive."""
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}.")


def nll_loss(chosen_logps: Tensor, chosen_lengths: Tensor) -> Tensor:
    """RPO / SFT term: mean over pairs of the chosen response's per-token NLL, mean_i(-lp(y_w,i) / |y_w,i|).

    Each sequence is normalised by its own length and then pairs are averaged, so every pair weighs the same.
    TRL's ``loss_type=["sigmoid", "sft"]`` instead takes the cross-entropy over all chosen tokens of the
    batch, sum_i(-lp_i) / sum_i |y_i|, which weighs long responses more; the two agree when all lengths are
    equal.

    Shapes: ``[B]`` summed log-probs and ``[B]`` positive token counts -> 0-dim tensor.
    """
    if chosen_logps.dim() != 1:
        raise ValueError(f"chosen_logps must be 1-D [B], got shape {tuple(chosen_logps.shape)}.")
    lengths = _lengths("chosen_lengths", chosen_lengths, chosen_logps)
    return (-chosen_logps / lengths).mean()


def pair_values(output: DPOLossOutput, chosen_logps: Tensor, rejected_logps: Tensor) -> dict[str, Tensor]:
    """What DPO and online DPO log of each pair, all ``[B]`` and detached: the implicit rewards
    (``rewards/chosen``, ``rewards/rejected``), ``rewards/accuracy`` (1 where the chosen reward is strictly greater:
    a tie counts as wrong, so a policy equal to its reference scores 0), ``rewards/margin`` (chosen - rejected) and
    the summed log-probs ``chosen_logps`` and ``rejected_logps`` (``logps/chosen``, ``logps/rejected``).
    """
    chosen, rejected = output.chosen_rewards.detach(), output.rejected_rewards.detach()
    return {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/accuracy": (chosen > rejected).float(),
        "rewards/margin": chosen - rejected,
        "logps/chosen": chosen_logps.detach(),
        "logps/rejected": rejected_logps.detach(),
    }
