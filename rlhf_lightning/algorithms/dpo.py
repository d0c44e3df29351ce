"""Offline preference losses (DPO and its variants) from per-response log-probabilities.

Every input is one number per response: its log-probability summed over the response tokens (policy, and
the frozen reference for all but SimPO) and its token count. Each loss is returned per pair, ``[B]``; reducing
over the batch is left to the caller, so pair weights or masks can be applied first.

Notation: ``Delta_w = lp(y_w) - lp_ref(y_w)`` and ``Delta_l = lp(y_l) - lp_ref(y_l)`` are the log-ratios of
the chosen and rejected responses, ``Delta = Delta_w - Delta_l``; ``|y|`` is a response's token count.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

DPOLossType = Literal["sigmoid", "robust", "ipo", "hinge", "sigmoid_norm", "simpo"]

_LOSS_TYPES: tuple[str, ...] = get_args(DPOLossType)
# Label smoothing means "the label is flipped with probability eps", which only the log-sigmoid losses model;
# for the others a non-zero value would be silently ignored, so it is refused instead.
_SMOOTHABLE = ("sigmoid", "robust", "simpo")


class DPOLossOutput(NamedTuple):
    """Per-pair preference loss (differentiable) and detached diagnostics, all ``[B]``.

    ``chosen_rewards`` / ``rejected_rewards`` are the implicit rewards ``beta * (lp - lp_ref)`` of the summed
    log-probs (TRL's ``rewards/chosen``), for every loss type including IPO and ``sigmoid_norm``; for SimPO,
    which has no reference, they are ``beta * lp / |y|``.

    ``logits`` is the preference margin before ``beta``: the loss is a function of ``beta * logits`` for every
    type except IPO, whose loss is ``(logits - 1 / (2 beta))^2``. Per type:
    sigmoid, robust, hinge: ``Delta``; ipo, sigmoid_norm: ``Delta_w / |y_w| - Delta_l / |y_l|``;
    simpo: ``lp(y_w) / |y_w| - lp(y_l) / |y_l| - gamma / beta`` (TRL's CPO convention, so that
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


def _smoothed_sigmoid_loss(margin: Tensor, label_smoothing: float) -> Tensor:
    """cDPO: expected -log sigma under a label flipped with probability eps; eps = 0 is plain -log sigma."""
    loss = -F.logsigmoid(margin)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-margin)
    return loss


def check_dpo_arguments(beta: float, loss_type: str, label_smoothing: float) -> None:
    """Raise ``ValueError`` for a ``beta``, ``loss_type`` or ``label_smoothing`` that :func:`dpo_loss` refuses
    (so that a module can check its configuration before loading a model)."""
    if loss_type not in _LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {_LOSS_TYPES}, got {loss_type!r}.")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}.")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing}.")
    if label_smoothing and loss_type not in _SMOOTHABLE:
        raise ValueError(
            f"label_smoothing applies only to loss_type in {_SMOOTHABLE}; loss_type={loss_type!r} would "
            f"ignore label_smoothing={label_smoothing}."
        )


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    beta: float = 0.1,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> DPOLossOutput:
    """Per-pair offline preference loss; see :class:`DPOLossOutput` for the diagnostics returned with it.

    With ``x = beta * Delta`` and ``eps = label_smoothing``:

    - ``sigmoid`` (DPO, Rafailov et al. 2023; cDPO when eps > 0): ``-(1 - eps) log s(x) - eps log s(-x)``.
    - ``robust`` (Chowdhury et al. 2024): ``(-(1 - eps) log s(x) + eps log s(-x)) / (1 - 2 eps)``, TRL's sign.
      It is the unbiased estimate of the clean loss under labels flipped with probability eps:
      ``(1 - eps) L(Delta) + eps L(-Delta) = -log s(beta Delta)``.
    - ``ipo`` (Azar et al. 2023): ``(Delta_bar - 1 / (2 beta))^2`` with the per-token averaged margin
      ``Delta_bar = Delta_w / |y_w| - Delta_l / |y_l|``, as TRL does (summed log-ratios make the square grow
      with length; the IPO authors confirmed the averaged form to TRL).
    - ``hinge`` (SLiC, RSO): ``relu(1 - x)``.
    - ``sigmoid_norm`` (Tulu 3 ``dpo_norm``, TRL ``sigmoid_norm``): ``-log s(beta Delta_bar)``.
    - ``simpo`` (Meng et al. 2024; reference-free): ``-(1 - eps) log s(m) - eps log s(-m)`` with
      ``m = beta (lp(y_w) / |y_w| - lp(y_l) / |y_l|) - gamma``, the label smoothing of TRL's CPO trainer.
      ``ref_*`` are ignored.

    Label smoothing is accepted only by sigmoid, robust and simpo (the losses that model flipped labels).

    Shapes: every log-prob input ``[B]`` (summed over the response tokens), lengths ``[B]`` integer or float
    token counts, all positive. ``ref_*`` may be None only for simpo. Returns ``[B]`` tensors.
    """
    check_dpo_arguments(beta, loss_type, label_smoothing)
    if policy_chosen_logps.dim() != 1:
        raise ValueError(
            f"policy_chosen_logps must be 1-D [B], got shape {tuple(policy_chosen_logps.shape)}."
        )
    _check_logps("policy_rejected_logps", policy_rejected_logps, policy_chosen_logps)
    chosen_lengths = _lengths("chosen_lengths", chosen_lengths, policy_chosen_logps)
    rejected_lengths = _lengths("rejected_lengths", rejected_lengths, policy_chosen_logps)

    if loss_type == "simpo":
        chosen_average = policy_chosen_logps / chosen_lengths
        rejected_average = policy_rejected_logps / rejected_lengths
        logits = chosen_average - rejected_average - simpo_gamma / beta
        losses = _smoothed_sigmoid_loss(beta * logits, label_smoothing)
        return DPOLossOutput(
            losses, (beta * chosen_average).detach(), (beta * rejected_average).detach(), logits.detach()
        )

    if ref_chosen_logps is None:
        raise ValueError(
            f"ref_chosen_logps is required for loss_type={loss_type!r} (only 'simpo' is reference-free)."
        )
    if ref_rejected_logps is None:
        raise ValueError(
            f"ref_rejected_logps is required for loss_type={loss_type!r} (only 'simpo' is reference-free)."
        )
    _check_logps("ref_chosen_logps", ref_chosen_logps, policy_chosen_logps)
    _check_logps("ref_rejected_logps", ref_rejected_logps, policy_chosen_logps)

    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    if loss_type in ("ipo", "sigmoid_norm"):
        logits = chosen_logratios / chosen_lengths - rejected_logratios / rejected_lengths
    else:
        logits = chosen_logratios - rejected_logratios

    if loss_type == "sigmoid":
        losses = _smoothed_sigmoid_loss(beta * logits, label_smoothing)
    elif loss_type == "robust":
        # The flipped term enters with a + sign: subtracting the loss a flipped label would incur is what
        # makes the estimate unbiased (it can be negative, unlike cDPO's, which is a convex mixture).
        losses = (
            -(1.0 - label_smoothing) * F.logsigmoid(beta * logits)
            + label_smoothing * F.logsigmoid(-beta * logits)
        ) / (1.0 - 2.0 * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1.0 / (2.0 * beta)) ** 2
    else:  # sigmoid_norm
        losses = -F.logsigmoid(beta * logits)

    return DPOLossOutput(
        losses, (beta * chosen_logratios).detach(), (beta * rejected_logratios).detach(), logits.detach()
    )


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
