"""The functional forms of Gao et al. 2022 ("Scaling Laws for Reward Model Overoptimization") and their fit.

With ``d = sqrt(KL(pi || pi_init))``, the gold reward gained over the initial policy follows

* under RL:         ``R(d) = d * (alpha - beta * ln d)``
* under best-of-n:  ``R(d) = d * (alpha - beta * d)``

Both are linear in ``(alpha, beta)``, so the fit is an ordinary least-squares solve with no starting point to
choose and no optimiser to converge: the exact minimiser of the squared error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

Form = Literal["rl", "bon"]


def kl_distance(kl: float) -> float:
    """``d = sqrt(KL)``, Gao's distance from the initial policy (a slightly negative KL estimate counts as 0)."""
    return math.sqrt(max(kl, 0.0))


def gao_curve(d: np.ndarray | Sequence[float], alpha: float, beta: float, form: Form = "rl") -> np.ndarray:
    """``R(d)`` of the RL form ``d (alpha - beta ln d)`` or the best-of-n form ``d (alpha - beta d)``."""
    d = np.asarray(d, dtype=float)
    return alpha * d - beta * _second_feature(d, form)


def _second_feature(d: np.ndarray, form: Form) -> np.ndarray:
    if form == "bon":
        return d * d
    if form == "rl":
        # d ln d -> 0 as d -> 0, so the curve starts at the initial policy's reward as it must.
        return np.where(d > 0, d * np.log(np.where(d > 0, d, 1.0)), 0.0)
    raise ValueError(f"form must be 'rl' or 'bon', got {form!r}")


@dataclass(frozen=True)
class GaoFit:
    """A least-squares fit of a Gao form to ``(d, gold gain)`` points.

    ``r2`` is the coefficient of determination ``1 - SS_res / SS_tot`` (``SS_tot`` around the points' mean),
    so it says how much of the gain's variation the two-parameter curve explains.
    """

    alpha: float
    beta: float
    r2: float
    form: Form
    points: int

    @property
    def peak_d(self) -> float | None:
        """``d`` at which the fitted curve peaks (None when it never turns down: ``beta <= 0``)."""
        if self.beta <= 0:
            return None
        # dR/dd = alpha - beta (ln d + 1) for RL, alpha - 2 beta d for best-of-n.
        return math.exp(self.alpha / self.beta - 1.0) if self.form == "rl" else self.alpha / (2.0 * self.beta)

    @property
    def peak_kl(self) -> float | None:
        """KL (nats) at the fitted peak, ``peak_d ** 2``."""
        return None if self.peak_d is None else self.peak_d**2

    @property
    def peak_gain(self) -> float | None:
        """The fitted curve's maximum gain over the initial policy."""
        if self.peak_d is None:
            return None
        return float(gao_curve([self.peak_d], self.alpha, self.beta, self.form)[0])

    def __call__(self, d: np.ndarray | Sequence[float]) -> np.ndarray:
        return gao_curve(d, self.alpha, self.beta, self.form)

    def as_dict(self) -> dict[str, float | int | str | None]:
        """The fit and its peak, for a JSON summary (an undefined R², of points that never vary, is None)."""
        fields = {**asdict(self), "peak_d": self.peak_d, "peak_kl": self.peak_kl, "peak_gain": self.peak_gain}
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in fields.items()}


def fit_gao(d: np.ndarray | Sequence[float], gain: np.ndarray | Sequence[float], form: Form = "rl") -> GaoFit:
    """Least-squares ``alpha, beta`` of ``gain ~ R(d)`` for the RL or best-of-n form.

    Args:
        d: ``sqrt(KL)`` of each point (non-negative).
        gain: gold reward minus the initial policy's gold reward at each point.
        form: ``rl`` for ``d (alpha - beta ln d)``, ``bon`` for ``d (alpha - beta d)``.
    """
    d = np.asarray(d, dtype=float)
    gain = np.asarray(gain, dtype=float)
    if d.shape != gain.shape or d.ndim != 1:
        raise ValueError(f"d and gain must be 1-D and of one length, got {d.shape} and {gain.shape}")
    if np.any(d < 0):
        raise ValueError("d = sqrt(KL) must be non-negative")
    if np.count_nonzero(d > 0) < 2:
        raise ValueError("fitting two parameters needs at least two points with d > 0")
    features = np.stack([d, -_second_feature(d, form)], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(features, gain, rcond=None)
    residual = gain - features @ np.array([alpha, beta])
    total = float(np.sum((gain - gain.mean()) ** 2))
    r2 = 1.0 - float(np.sum(residual**2)) / total if total > 0 else float("nan")
    return GaoFit(float(alpha), float(beta), r2, form, int(d.size))


def best_of_n_kl(n: int | np.ndarray) -> float | np.ndarray:
    """KL of the best-of-n policy to the policy it samples from: ``log n - (n - 1) / n`` nats (Stiennon et al.
    2020; exact for a continuous score with no ties)."""
    n_array = np.asarray(n, dtype=float)
    if np.any(n_array < 1):
        raise ValueError("n must be at least 1")
    kl = np.log(n_array) - (n_array - 1.0) / n_array
    return float(kl) if kl.ndim == 0 else kl
