"""The family study's numbers: gold at matched KL, curves over seeds, Gao fits, the table.

A run's trajectory is its evaluations in order, starting with the SFT policy (step 0, KL 0). Gold at a given KL
is read where the trajectory first reaches that KL, by linear interpolation in ``d = sqrt(KL)`` between the two
evaluations either side (gold grows about linearly in d early on, Gao et al., so this does not penalise a run
whose first evaluation is already far out; KL is not monotone over a run, so the first crossing is the one a
researcher stopping at that KL would get). A method's *frontier* at a KL, for one seed, is the best of its strengths there: the method with its KL
strength tuned on that seed's runs, which every method gets the same number of times. Spread is the sample
standard deviation over seeds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlhf_lightning.study.best_of_n import BestOfNPoint
from rlhf_lightning.study.evaluation import EvalPoint, MethodRun
from rlhf_lightning.study.gao import GaoFit, fit_gao


def value_at(points: Sequence[Any], x: float, along: str = "kl", value: str = "gold") -> float | None:
    """``value`` where ``points`` (in order) first reach ``along == x``, interpolated linearly; None if never.
    """
    previous = None
    for point in points:
        here = getattr(point, along)
        if here >= x:
            if previous is None:
                return float(getattr(point, value)) if here == x else None
            before = getattr(previous, along)
            share = (x - before) / (here - before)
            return float(getattr(previous, value) + share * (getattr(point, value) - getattr(previous, value)))
        previous = point
    return None


def frontier(runs: Iterable[MethodRun], kl: float, value: str = "gold") -> float | None:
    """The best ``value`` at ``kl`` over ``runs`` (one method, one seed, its strengths); None if none reaches it.
    """
    reached = [v for run in runs if (v := value_at(run.points, math.sqrt(kl), "d", value)) is not None]
    return max(reached) if reached else None


def mean_spread(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    array = np.asarray(values, dtype=float)
    return float(array.mean()), float(array.std(ddof=1)) if array.size > 1 else 0.0


def by_seed(runs: Iterable[MethodRun]) -> dict[int, list[MethodRun]]:
    """Runs grouped by seed, seeds in order."""
    groups: dict[int, list[MethodRun]] = {}
    for run in sorted(runs, key=lambda r: (r.seed, r.strength)):
        groups.setdefault(run.seed, []).append(run)
    return groups


def sft_baseline(runs: Iterable[MethodRun]) -> dict[int, EvalPoint]:
    """The SFT policy's evaluation per seed: step 0 of a run (every run of a seed starts from the same policy,
    evaluated with the same seeds)."""
    return {seed: group[0].points[0] for seed, group in by_seed(runs).items()}


def seed_curve(per_seed: dict[int, Callable[[float], float | None]], grid: Sequence[float]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean and spread over seeds of per-seed curves on ``grid``, where every seed's curve is defined.

    Returns ``(x, mean, spread)`` restricted to those grid points.
    """
    xs, means, spreads = [], [], []
    for x in grid:
        values = [curve(x) for curve in per_seed.values()]
        if values and all(v is not None for v in values):
            mean, spread = mean_spread(values)
            xs.append(x)
            means.append(mean)
            spreads.append(spread)
    return np.array(xs), np.array(means), np.array(spreads)


def best_of_n_value(curve: Sequence[BestOfNPoint], kl: float, value: str = "gold") -> float | None:
    """Best-of-n's ``value`` at ``kl`` (interpolated in sqrt(KL) between the measured n); None beyond the largest
    n.

    Best-of-n gains are measured from the curve's own ``n = 1`` (its ``N`` samples per prompt estimate the SFT
    policy's mean more closely than the evaluation's single sample does).
    """
    return value_at(curve, math.sqrt(kl), "d", value)


def seed_fits(runs: Iterable[MethodRun], value: str = "gold") -> dict[int, tuple[GaoFit, float]]:
    """Per seed, Gao's RL form fitted to the gain in ``value`` over the SFT policy at every evaluation of
    ``runs`` (one method, all its strengths), and the largest ``d`` the seed's runs reached (the fit is only
    drawn up to there). Seeds with fewer than two points away from the SFT policy are left out."""
    fits = {}
    for seed, group in by_seed(runs).items():
        start = getattr(group[0].points[0], value)
        points = [(p.d, getattr(p, value) - start) for run in group for p in run.points]
        if sum(1 for d, _ in points if d > 0) >= 2:
            d, gain = zip(*points, strict=True)
            fits[seed] = fit_gao(np.array(d), np.array(gain), "rl"), max(d)
    return fits


def matched_kl_table(runs: Sequence[MethodRun], best_of_n: dict[int, Sequence[BestOfNPoint]],
                     kls: Sequence[float], labels: dict[str, str]) -> list[dict[str, Any]]:
    """One row per method: gold gain over the seed's SFT policy at each matched KL (frontier over strengths),
    mean ± spread over the seeds that reach it, and the peak gain with the KL where it happened."""
    baseline = sft_baseline(runs)
    rows = []
    for method, label in labels.items():
        mine = [run for run in runs if run.method == method]
        if not mine:
            continue
        row: dict[str, Any] = {"method": method, "label": label, "seeds": len(by_seed(mine))}
        for kl in kls:
            gains = [v - baseline[seed].gold for seed, group in by_seed(mine).items()
                     if (v := frontier(group, kl)) is not None]
            row[f"kl_{kl:g}"] = _cell(gains)
        peaks = [max((p for run in group for p in run.points), key=lambda p: p.gold)
                 for group in by_seed(mine).values()]
        row["peak"] = _cell([p.gold - baseline[seed].gold for seed, p in zip(by_seed(mine), peaks, strict=True)])
        row["peak_kl"] = _cell([p.kl for p in peaks])
        row["cpu_seconds"] = _cell([run.cpu_seconds for run in mine])
        rows.append(row)
    if best_of_n:
        row = {"method": "best_of_n", "label": "best-of-n (SFT policy)", "seeds": len(best_of_n)}
        for kl in kls:
            row[f"kl_{kl:g}"] = _cell([v - curve[0].gold for curve in best_of_n.values()
                                       if (v := best_of_n_value(curve, kl)) is not None])
        peaks = {seed: max(curve, key=lambda p: p.gold) for seed, curve in best_of_n.items()}
        row["peak"] = _cell([p.gold - best_of_n[seed][0].gold for seed, p in peaks.items()])
        row["peak_kl"] = _cell([p.kl for p in peaks.values()])
        rows.append(row)
    return rows


def compute_table(runs: Sequence[MethodRun], best_of_n: dict[int, Sequence[BestOfNPoint]],
                  best_of_n_seconds: dict[int, float], budgets: Sequence[float], labels: dict[str, str],
                  shipped: dict[str, float]) -> list[dict[str, Any]]:
    """One row per method at its shipped strength: gold gain over the seed's SFT policy after each budget of
    training CPU-seconds (interpolated between evaluations), mean ± spread over the seeds whose run lasted that
    long. Best-of-n costs its measured sampling and scoring time, scaled from N to n."""
    baseline = sft_baseline(runs)
    rows = []
    for method, label in labels.items():
        mine = [run for run in runs if run.method == method and run.strength == shipped[method]]
        if not mine:
            continue
        row: dict[str, Any] = {"method": method, "label": f"{label} ({shipped[method]:g})", "seeds": len(mine)}
        for budget in budgets:
            row[f"cpu_{budget:g}"] = _cell([v - baseline[run.seed].gold for run in mine
                                            if (v := value_at(run.points, budget, "cpu_seconds")) is not None])
        rows.append(row)
    if best_of_n:
        row = {"method": "best_of_n", "label": "best-of-n (SFT policy)", "seeds": len(best_of_n)}
        for budget in budgets:
            gains = []
            for seed, curve in best_of_n.items():
                largest = max(point.n for point in curve)
                costed = [_Costed(best_of_n_seconds[seed] * point.n / largest, point.gold) for point in curve]
                if (v := value_at(costed, budget, "cpu_seconds")) is not None:
                    gains.append(v - curve[0].gold)
            row[f"cpu_{budget:g}"] = _cell(gains)
        rows.append(row)
    return rows


@dataclass
class _Costed:
    cpu_seconds: float
    gold: float


def _cell(values: Sequence[float]) -> dict[str, Any] | None:
    if not values:
        return None
    mean, spread = mean_spread(values)
    return {"mean": mean, "spread": spread, "seeds": len(values), "values": [float(v) for v in values]}


def gao_fits(runs: Sequence[MethodRun], best_of_n: dict[int, Sequence[BestOfNPoint]], rl_methods: Iterable[str],
             min_d: float) -> dict[str, dict[str, Any] | None]:
    """Gao et al.'s RL form fitted to every evaluation of each RL method (all strengths and seeds, gain over the
    seed's SFT policy, points with ``d >= min_d``), and the best-of-n form to the best-of-n curves."""
    baseline = sft_baseline(runs)
    fits: dict[str, dict[str, Any] | None] = {}
    for method in rl_methods:
        points = [(p.d, p.gold - baseline[run.seed].gold) for run in runs if run.method == method
                  for p in run.points if p.d >= min_d]
        fits[method] = _fit(points, "rl")
    if best_of_n:
        points = [(p.d, p.gold - curve[0].gold) for curve in best_of_n.values() for p in curve]
        fits["best_of_n"] = _fit(points, "bon")
    return fits


def _fit(points: Sequence[tuple[float, float]], form: str) -> dict[str, Any] | None:
    if sum(1 for d, _ in points if d > 0) < 2:
        return None
    d, gain = zip(*points, strict=True)
    return fit_gao(np.array(d), np.array(gain), form).as_dict()


def format_cell(cell: dict[str, Any] | None, seeds: int, digits: int = 2) -> str:
    """``+1.23 ± 0.45`` (with ``(2/3)`` when only some seeds reach it), ``–`` when none does."""
    if cell is None:
        return "–"
    text = f"{cell['mean']:+.{digits}f} ± {cell['spread']:.{digits}f}"
    return text if cell["seeds"] == seeds else f"{text} ({cell['seeds']}/{seeds})"


def markdown_compute_table(rows: Sequence[dict[str, Any]], budgets: Sequence[float]) -> str:
    """The compute table as Markdown: gold gain after each budget of training CPU-seconds."""
    header = ["method (strength)", *[f"gold gain after {budget:g} CPU-s" for budget in budgets]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["label"], *[format_cell(row[f"cpu_{budget:g}"], row["seeds"]) for budget in budgets]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict[str, Any]], kls: Sequence[float], fits: dict[str, Any]) -> str:
    """The table as Markdown: gold gain at each matched KL, the peak and its KL, the Gao fit's peak, CPU-s."""
    header = ["method", *[f"gold gain at KL {kl:g}" for kl in kls], "peak gain (at KL)", "Gao fit: α, β, R²",
              "CPU-s per run"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        seeds = row["seeds"]
        fit = fits.get(row["method"])
        fit_text = (f"{fit['alpha']:.2f}, {fit['beta']:.2f}, {fit['r2']:.2f}"
                    if fit and fit.get("r2") is not None else "–")
        peak_kl = row["peak_kl"]
        peak = f"{format_cell(row['peak'], seeds)} ({peak_kl['mean']:.1f})" if row["peak"] else "–"
        cpu = row.get("cpu_seconds")
        cpu_text = f"{cpu['mean']:.0f}" if cpu else "–"
        cells = [row["label"], *[format_cell(row[f"kl_{kl:g}"], seeds) for kl in kls], peak, fit_text, cpu_text]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

