"""DPO's losses: a registry of per-pair losses of the preference margin, each with its arguments as one typed group.

A loss is a subclass of :class:`PreferenceLoss`: its constructor's arguments are its group in the config, ``__call__``
maps the margin ``logits`` ``[B]`` to a loss per pair; ``margin`` and ``implicit_rewards`` say how the pair's
log-ratios make them (summed or per token; SimPO's reference-free averages). Defining the class registers it; a
config names it by class name or import path::

    loss: IPO                                         # a registered loss with its defaults
    loss:                                             # one with arguments
      class_path: SimPO
      init_args: {gamma: 0.5, label_smoothing: 0.1}

Notation as in :mod:`rlhf_lightning.algorithms.dpo`: ``Delta_w``, ``Delta_l`` the chosen and rejected log-ratios,
``|y|`` a response's token count, ``x = beta * logits``, ``eps`` the label smoothing. Each loss's ``name`` is TRL's
``loss_type`` for it, and names its curve (``dpo/loss (sigmoid)``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_lightning.algorithms.registered import Registered
from rlhf_lightning.utils import checks


def check_label_smoothing(value: float) -> float:
    if not 0.0 <= value < 0.5:
        raise ValueError(f"loss.label_smoothing must lie in [0, 0.5), got {value}.")
    return value


def smoothed_sigmoid_loss(margin: Tensor, label_smoothing: float) -> Tensor:
    """cDPO: expected -log sigma under a label flipped with probability eps; eps = 0 is plain -log sigma."""
    loss = -F.logsigmoid(margin)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-margin)
    return loss


class PreferenceLoss(Registered):
    """Base of DPO's losses. Subclass it, take the loss's arguments in ``__init__`` (checked there) and define
    ``__call__``; set ``uses_reference = False`` for a reference-free loss and ``per_token_margin = True`` for a
    margin of per-token log-ratios. Defining the class registers it (a name we ship is refused)."""

    registry: ClassVar[dict[str, type[PreferenceLoss]]] = {}
    family = "DPO loss"
    uses_reference: ClassVar[bool] = True  # log-ratios against the reference, or the policy's log-probs alone
    per_token_margin: ClassVar[bool] = False  # Delta_w / |y_w| - Delta_l / |y_l| instead of Delta_w - Delta_l

    @property
    def name(self) -> str:
        """The loss's name in logged metrics: TRL's ``loss_type`` for ours, the class name for yours."""
        return type(self).__name__

    def margin(self, chosen: Tensor, rejected: Tensor, chosen_lengths: Tensor, rejected_lengths: Tensor,
               beta: float) -> Tensor:
        """The pair's margin before ``beta`` (``logits``) from the chosen and rejected log-ratios (log-probs for a
        reference-free loss), ``[B]`` each."""
        if self.per_token_margin:
            return chosen / chosen_lengths - rejected / rejected_lengths
        return chosen - rejected

    def implicit_rewards(self, chosen: Tensor, rejected: Tensor, chosen_lengths: Tensor, rejected_lengths: Tensor,
                         beta: float) -> tuple[Tensor, Tensor]:
        """The chosen and rejected responses' implicit rewards: ``beta`` times their summed log-ratios (TRL's
        ``rewards/chosen``), whatever the margin."""
        return beta * chosen, beta * rejected

    def __call__(self, logits: Tensor, beta: float) -> Tensor:
        """The loss of each pair ``[B]`` from its margin ``logits`` ``[B]``."""
        raise NotImplementedError


class Sigmoid(PreferenceLoss):
    """DPO (Rafailov et al. 2023; cDPO when eps > 0): -(1 - eps) log s(x) - eps log s(-x).

    Args:
        label_smoothing: probability eps that a label is flipped (cDPO), in [0, 0.5).
    """

    name = "sigmoid"

    def __init__(self, label_smoothing: float = 0.0) -> None:
        self.label_smoothing = check_label_smoothing(label_smoothing)

    def __call__(self, logits: Tensor, beta: float) -> Tensor:
        return smoothed_sigmoid_loss(beta * logits, self.label_smoothing)


class Robust(PreferenceLoss):
    """Robust DPO (Chowdhury et al. 2024): (-(1 - eps) log s(x) + eps log s(-x)) / (1 - 2 eps), TRL's sign. It is
    the unbiased estimate of the clean loss under labels flipped with probability eps:
    ``(1 - eps) L(Delta) + eps L(-Delta) = -log s(beta Delta)``.

    Args:
        label_smoothing: probability eps that a label is flipped, in [0, 0.5).
    """

    name = "robust"

    def __init__(self, label_smoothing: float = 0.0) -> None:
        self.label_smoothing = check_label_smoothing(label_smoothing)

    def __call__(self, logits: Tensor, beta: float) -> Tensor:
        # The flipped term enters with a + sign: subtracting the loss a flipped label would incur is what makes the
        # estimate unbiased (it can be negative, unlike cDPO's, which is a convex mixture).
        eps = self.label_smoothing
        return (-(1.0 - eps) * F.logsigmoid(beta * logits) + eps * F.logsigmoid(-beta * logits)) / (1.0 - 2.0 * eps)


class IPO(PreferenceLoss):
    """IPO (Azar et al. 2023): (Delta_bar - 1 / (2 beta))^2 with the per-token averaged margin
    ``Delta_bar = Delta_w / |y_w| - Delta_l / |y_l|``, as TRL does (summed log-ratios make the square grow with
    length; the IPO authors confirmed the averaged form to TRL)."""

    name = "ipo"
    per_token_margin = True

    def __call__(self, logits: Tensor, beta: float) -> Tensor:
        return (logits - 1.0 / (2.0 * beta)) ** 2


class Hinge(PreferenceLoss):
    """SLiC's hinge (Zhao et al. 2023; RSO): relu(1 - x)."""

    name = "hinge"

    def __call__(self, logits: Tensor, beta: float) -> Tensor:
        return torch.relu(1.0 - beta * logits)


class SigmoidNorm(PreferenceLoss):
    """Length-normalised DPO (Tulu 3's ``dpo_norm``, TRL's ``sigmoid_norm``): -log s(beta Delta_bar), the per-token
    averaged margin of :class:`IPO`; it wants a larger beta (~5)."""

    name = "sigmoid_norm"
    per_token_margin = True

    def __call__(self, logits: Tensor, beta: float) -> Tensor:
        return -F.logsigmoid(beta * logits)


class SimPO(PreferenceLoss):
    """SimPO (Meng et al. 2024), reference-free: -(1 - eps) log s(m) - eps log s(-m) with
    ``m = beta (lp(y_w) / |y_w| - lp(y_l) / |y_l|) - gamma`` (the label smoothing of TRL's CPO trainer). Its
    ``logits`` are ``lp(y_w) / |y_w| - lp(y_l) / |y_l| - gamma / beta`` (TRL's CPO convention) and its implicit
    rewards ``beta * lp(y) / |y|``; it wants a larger beta (~2).

    Args:
        gamma: the target margin.
        label_smoothing: probability eps that a label is flipped, in [0, 0.5).
    """

    name = "simpo"
    uses_reference = False

    def __init__(self, gamma: float = 0.5, label_smoothing: float = 0.0) -> None:
        checks.non_negative("loss.gamma", gamma)
        self.gamma = gamma
        self.label_smoothing = check_label_smoothing(label_smoothing)

    def margin(self, chosen: Tensor, rejected: Tensor, chosen_lengths: Tensor, rejected_lengths: Tensor,
               beta: float) -> Tensor:
        return chosen / chosen_lengths - rejected / rejected_lengths - self.gamma / beta

    def implicit_rewards(self, chosen: Tensor, rejected: Tensor, chosen_lengths: Tensor, rejected_lengths: Tensor,
                         beta: float) -> tuple[Tensor, Tensor]:
        return beta * (chosen / chosen_lengths), beta * (rejected / rejected_lengths)

    def __call__(self, logits: Tensor, beta: float) -> Tensor:
        return smoothed_sigmoid_loss(beta * logits, self.label_smoothing)

