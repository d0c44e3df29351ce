"""The study's numbers: Gao fits of each run's gold curve, peaks and final values, the best-of-n fit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rlhf_lightning.study.best_of_n import BestOfNPoint
from rlhf_lightning.study.gao import GaoFit, fit_gao
from rlhf_lightning.study.runs import Point, RunResult


def summarise_run(run: RunResult, points: Sequence[Point], gold0: float) -> dict[str, Any]:
    """Peak and final gold of a run, and whether the proxy kept rising past the gold peak."""
    peak = max(points, key=lambda p: p.gold)
    last = points[-1]
    return {
        "kl_coef": run.kl_coef,
        "peak_gold": peak.gold, "peak_kl": peak.kl, "peak_iteration": peak.iteration,
        "final_gold": last.gold, "final_proxy": last.proxy, "final_kl": last.kl,
        "final_iteration": last.iteration,
        "gold_gain_at_peak": peak.gold - gold0, "gold_drop_from_peak": peak.gold - last.gold,
        "proxy_rise_after_gold_peak": last.proxy - peak.proxy,
        "seconds": round(run.seconds, 1),
    }


def fit_run(points: Sequence[Point], gold0: float, min_d: float = 0.0) -> GaoFit | None:
    """Gao's RL form fitted to a run's gold gain over the points with ``d >= min_d``, or None when fewer than
    two such points have ``d > 0``."""
    kept = [p for p in points if p.d >= min_d]
    d = np.array([p.d for p in kept])
    if np.count_nonzero(d > 0) < 2:
        return None
    return fit_gao(d, np.array([p.gold for p in kept]) - gold0, "rl")


Analysis = tuple[dict[str, Any], dict[float, list[Point]], dict[float, GaoFit], GaoFit | None]


def analyse(runs: Sequence[RunResult], curve: Sequence[BestOfNPoint], baseline: tuple[float, float],
            fit_on: str, fit_min_d: float) -> Analysis:
    """Fits and summary numbers: ``(summary, points by kl_coef, RL fits by kl_coef, best-of-n fit)``.

    The headline fit is the run with the smallest KL coefficient (0 by default): unpenalised optimisation,
    where over-optimisation is plainest, as in Gao et al.
    """
    gold0, proxy0 = baseline
    points = {run.kl_coef: run.eval if fit_on == "eval" and run.eval else run.train for run in runs}
    fits = {k: fit for k, series in points.items() if (fit := fit_run(series, gold0, fit_min_d)) is not None}
    fits_all = {k: fit for k, series in points.items() if (fit := fit_run(series, gold0)) is not None}
    bon_fit = None
    if len(curve) >= 3:
        bon_fit = fit_gao([p.d for p in curve], [p.gold - gold0 for p in curve], "bon")
    runs_summary = [
        summarise_run(run, points[run.kl_coef], gold0)
        | {"fit": fits[run.kl_coef].as_dict() if run.kl_coef in fits else None,
           "fit_all_points": fits_all[run.kl_coef].as_dict() if run.kl_coef in fits_all else None}
        for run in runs
    ]
    headline = min(fits, key=abs) if fits else None
    fit = fits[headline].as_dict() if headline is not None else {}
    run = next((r for r in runs_summary if r["kl_coef"] == headline), {})
    summary = {
        "fit_kl_coef": headline, "fit_on": fit_on, "fit_min_d": fit_min_d,
        "alpha": fit.get("alpha"), "beta": fit.get("beta"), "r2": fit.get("r2"),
        "fit_points": fit.get("points"),
        "r2_all_points": fits_all[headline].as_dict()["r2"] if headline in fits_all else None,
        "fit_peak_kl": fit.get("peak_kl"),
        "peak_gold": run.get("peak_gold"), "peak_kl": run.get("peak_kl"),
        "final_gold": run.get("final_gold"), "final_kl": run.get("final_kl"),
        "sft_gold": gold0, "sft_proxy": proxy0,
        "runs": runs_summary,
        "best_of_n": [vars(p) for p in curve],
        "best_of_n_fit": bon_fit.as_dict() if bon_fit else None,
    }
    return summary, points, fits, bon_fit
