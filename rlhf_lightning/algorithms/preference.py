"""Bradley-Terry reward-model loss."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(
    chosen: Tensor, rejected: Tensor, margin: Tensor | None = None, center_coef: float = 0.0,
    weights: Tensor | None = None,
) -> Tensor:
    """Mean of ``-log sigmoid(r_chosen - r_rejected - margin)``, plus ``center_coef * mean((r_c + r_r)^2)``.

    The margin asks the chosen reward to exceed the rejected one by at least that much (Llama 2's margin loss);
    the centering term (Eisenstein et al. 2023) keeps rewards near zero, which the loss alone leaves free.
    ``weights``: a weight per pair (an ensemble member's share of the data,
    :func:`~rlhf_lightning.algorithms.ensemble.pair_weights`): both means become weighted means,
    ``sum(w * l) / sum(w)`` (0 where every weight is 0). Shapes: ``[B]`` each; returns a 0-dim tensor.
    """
    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin
    if weights is None:
        loss = -F.logsigmoid(difference).mean()
        if center_coef:
            loss = loss + center_coef * ((chosen + rejected) ** 2).mean()
        return loss
    total = weights.sum().clamp(min=1e-12)
    loss = -(weights * F.logsigmoid(difference)).sum() / total
    if center_coef:
        loss = loss + center_coef * (weights * (chosen + rejected) ** 2).sum() / total
    return loss
