"""Per-token KL penalty between the policy and the frozen reference model, its coefficient controllers, and its
settings (one group of arguments)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from rlhf_lightning.algorithms.masked import last_marked_index
from rlhf_lightning.utils import checks

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


@dataclass(frozen=True)
class KLPenalty:
    """The KL penalty to the reference (the base, adapters disabled): the ``kl`` argument of the policy-gradient
    algorithms. Each algorithm has its own defaults (its ``default_kl``; GRPO's: coefficient 0, k3, in the loss):
    a config that sets some fields keeps the algorithm's others, and so does a dict of fields from Python
    (``GRPO(kl={"coef": 0.04}, ...)``); a ``KLPenalty`` given whole replaces them all.

    Args:
        coef: coefficient of the penalty (the initial one when ``target`` is set); 0 with no ``target`` = no
            reference pass at all.
        estimator: per-token KL estimator: ``k1`` (log-ratio), ``k2`` or ``k3`` (Schulman).
        clamp: clamp every per-token KL estimate to [-clamp, clamp], as OpenRLHF does with 10 (it biases the
            estimate where the policy has moved far from the reference); null = off.
        added_to: where the penalty goes: ``reward`` (shaped into the rewards before the advantages: per token,
            or summed over the response for the group baselines) or ``loss`` (a term of the loss, GRPO's way).
        ratio_weighting: with ``added_to: loss``, weight each token's KL term by the policy loss's importance ratio
            (TRL 1.16's bias correction: the tokens were sampled from the old policy).
        target: target KL per sequence (nats) of the adaptive controller; null = a fixed ``coef``.
        horizon: horizon of the adaptive controller, in samples (with ``target``).
    """

    coef: float = 0.05
    estimator: KLEstimator = "k1"
    clamp: float | None = None
    added_to: Literal["reward", "loss"] = "reward"
    ratio_weighting: bool = True
    target: float | None = None
    horizon: int = 10_000

    def check(self, name: str = "kl") -> KLPenalty:
        """Raise a one-line error naming ``name.field`` for a value out of range."""
        checks.non_negative(f"{name}.coef", self.coef)
        checks.positive(f"{name}.clamp", self.clamp, optional=True)
        checks.positive(f"{name}.target", self.target, optional=True)
        checks.at_least(f"{name}.horizon", self.horizon)
        checks.one_of(f"{name}.estimator", self.estimator, _ESTIMATORS)
        checks.one_of(f"{name}.added_to", self.added_to, ("reward", "loss"))
        if self.target is not None and self.coef == 0:
            raise ValueError(f"{name}.target={self.target} with {name}.coef=0: the adaptive controller multiplies the "
                             f"coefficient, so it would stay 0; start it from a {name}.coef > 0 (e.g. 0.05)")
        return self

    def controller(self) -> FixedKLController | AdaptiveKLController:
        """The coefficient's controller: fixed, or adaptive towards ``target``."""
        if self.target is None:
            return FixedKLController(self.coef)
        return AdaptiveKLController(self.coef, self.target, self.horizon)


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
