"""Per-token KL penalty between the policy and the frozen reference model, and its coefficient controllers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, get_args

import torch
from torch import Tensor

from rlhf_lightning.algorithms.masked import last_marked_index

KLEstimator = Literal["k1", "k2", "k3"]
_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k1",
               clamp: float | None = None) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi, with r = logprobs - ref_logprobs.

    k1 = r (unbiased, can be negative); k2 = r^2 / 2 (biased, low variance);
    k3 = exp(-r) - 1 + r (unbiased and non-negative; Schulman, "Approximating KL Divergence").
    ``clamp``: limit each estimate to [-clamp, clamp], as OpenRLHF 0.11's ``compute_approx_kl`` does with 10
    (which biases the estimate where the policy has moved far; None = the estimator itself).
    Shapes: ``[B, T]`` (any shape, elementwise) -> same shape.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio**2
    elif estimator == "k3":
        # expm1 keeps precision when pi and pi_ref nearly agree (small r), the usual case.
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        raise ValueError(f"Unknown KL estimator {estimator!r}; expected one of {', '.join(_ESTIMATORS)}.")
    return kl if clamp is None else kl.clamp(min=-clamp, max=clamp)


def _check_coef(coef: float) -> float:
    if coef < 0:
        raise ValueError(f"The KL coefficient must be >= 0, got {coef}.")
    return float(coef)


class FixedKLController:
    """KL coefficient that stays at ``coef`` for the whole run."""

    def __init__(self, coef: float) -> None:
        self.value = _check_coef(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient unchanged (same interface as :class:`AdaptiveKLController`)."""

    def state_dict(self) -> dict[str, float]:
        """Current coefficient, for checkpoints."""
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore the coefficient saved by :meth:`state_dict`."""
        self.value = _check_coef(state["value"])


class AdaptiveKLController:
    """KL coefficient steered towards a target KL (Ziegler et al. 2019, lm-human-preferences / InstructGPT).

    Each update: e = clip(current_kl / target - 1, -0.2, 0.2); value *= 1 + e * n_steps / horizon.
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if target <= 0:
            raise ValueError(f"The KL target must be > 0, got {target}.")
        if horizon <= 0:
            raise ValueError(f"The KL horizon must be > 0, got {horizon}.")
        self.value = _check_coef(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient by at most 20% per ``horizon`` steps towards the one giving ``target`` KL."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """Current (adapted) coefficient, so a resumed run continues from it rather than from ``init_coef``."""
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore the coefficient saved by :meth:`state_dict`; target and horizon come from the config."""
        self.value = _check_coef(state["value"])


def token_rewards(scores: Tensor, kl: Tensor, response_mask: Tensor, kl_coef: float) -> Tensor:
    """Per-token rewards ``[B, R]``: ``-kl_coef * kl_t`` on every response token, plus the sequence score at its
    last token (InstructGPT / Ziegler et al.). Shapes: ``scores`` ``[B]``, ``kl`` and ``response_mask`` ``[B, R]``
    (an episode's mask may have holes: the score goes to its last policy token)."""
    rewards = torch.where(response_mask, -kl_coef * kl, torch.zeros_like(kl))
    last = last_marked_index(response_mask)
    rows = torch.arange(scores.shape[0], device=scores.device)
    rewards[rows, last] += scores
    return rewards
