"""The family study's figures: gold and proxy gain against sqrt(KL), and gold gain against training CPU time,
each method's mean over seeds with a band of one standard deviation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rlhf_lightning.study.best_of_n import BestOfNPoint
from rlhf_lightning.study.evaluation import MethodRun
from rlhf_lightning.study.frontier import (
    best_of_n_value,
    by_seed,
    seed_curve,
    seed_fits,
    sft_baseline,
    value_at,
)
from rlhf_lightning.study.plot import COLOURS


def _figure(panels: int):
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    figure = Figure(figsize=(6.4 * panels, 4.8), dpi=100, layout="constrained")
    return figure, figure.subplots(1, panels, squeeze=False)[0]


def _band(axes, x, mean, spread, colour, label) -> None:
    if len(x) == 0:
        return
    axes.plot(x, mean, color=colour, linewidth=2.0, label=label)
    axes.fill_between(x, mean - spread, mean + spread, color=colour, alpha=0.18, linewidth=0)


def plot_kl(path: str | Path, runs: Sequence[MethodRun], best_of_n: dict[int, Sequence[BestOfNPoint]],
            labels: dict[str, str], title: str = "") -> Path:
    """Gold (left) and proxy (right) gain over the SFT policy against ``d = sqrt(KL)``.

    Dots are every evaluation of every strength and seed. Each method's line is the mean over seeds of Gao's RL
    form ``d (alpha - beta ln d)`` fitted per seed to all that seed's evaluations of the method, drawn as far
    as every seed's runs reached; the band is ± one standard deviation over seeds. Best-of-n is its measured
    curve (gain from its own n = 1), mean ± spread over seeds.
    """
    figure, axes = _figure(2)
    max_d = max([p.d for run in runs for p in run.points] + [p.d for c in best_of_n.values() for p in c] + [1e-3])
    grid = np.linspace(0.0, max_d, 120)
    for panel, value in zip(axes, ("gold", "proxy"), strict=True):
        for index, (method, label) in enumerate(labels.items()):
            colour = COLOURS[index % len(COLOURS)]
            mine = [run for run in runs if run.method == method]
            if not mine:
                continue
            starts = {run.seed: getattr(run.points[0], value) for run in mine}
            points = [(p.d, getattr(p, value) - starts[run.seed]) for run in mine for p in run.points]
            panel.scatter(*zip(*points, strict=True), s=6, color=colour, alpha=0.3, linewidths=0)
            fits = seed_fits(mine, value)
            curves = {seed: (lambda d, f=fit, end=reach: float(f([d])[0]) if d <= end else None)
                      for seed, (fit, reach) in fits.items()}
            _band(panel, *seed_curve(curves, grid), colour, f"{label} ({len(fits)} seeds)")
        if best_of_n:
            curves = {seed: (lambda d, c=curve, v=value: _minus(best_of_n_value(c, d * d, v), getattr(c[0], v)))
                      for seed, curve in best_of_n.items()}
            _band(panel, *seed_curve(curves, grid), "black", "best-of-n of the SFT policy")
        _decorate(panel, "d = √KL(π ‖ π_SFT)   (√nats)", f"{value} gain over the SFT policy",
                  f"{value} reward{' (the hidden true reward)' if value == 'gold' else ' (the reward model)'}"
                  ": per-seed Gao fits, mean ± SD")
    if title:
        figure.suptitle(title, fontsize=10)
    return _save(figure, path)


def plot_compute(path: str | Path, runs: Sequence[MethodRun], best_of_n: dict[int, Sequence[BestOfNPoint]],
                 best_of_n_seconds: dict[int, float], labels: dict[str, str], shipped: dict[str, float],
                 title: str = "") -> Path:
    """Gold gain over the SFT policy against training CPU-seconds, each method at its shipped strength (mean
    over seeds where every seed has run that long, ± one standard deviation); best-of-n as points, its cost
    the measured cost of sampling and scoring N responses per prompt scaled to n."""
    baseline = sft_baseline(runs)
    figure, axes = _figure(1)
    panel = axes[0]
    for index, (method, label) in enumerate(labels.items()):
        colour = COLOURS[index % len(COLOURS)]
        groups = {seed: [run for run in group if run.strength == shipped.get(method)]
                  for seed, group in by_seed(run for run in runs if run.method == method).items()}
        groups = {seed: group[0] for seed, group in groups.items() if group}
        if not groups:
            continue
        end = min(run.cpu_seconds for run in groups.values())
        curves = {seed: (lambda t, r=run, s=seed: _minus(value_at(r.points, t, "cpu_seconds", "gold"),
                                                         baseline[s].gold))
                  for seed, run in groups.items()}
        strength = f"{shipped[method]:g}"
        _band(panel, *seed_curve(curves, np.linspace(0.0, end, 60)), colour, f"{label} ({strength})")
    if best_of_n:
        ns = sorted({p.n for curve in best_of_n.values() for p in curve})
        costs, gains = [], []
        for n in ns:
            values = [p.gold - curve[0].gold for curve in best_of_n.values() for p in curve if p.n == n]
            largest = {seed: max(p.n for p in curve) for seed, curve in best_of_n.items()}
            costs.append(float(np.mean([best_of_n_seconds[seed] * n / largest[seed] for seed in best_of_n])))
            gains.append(float(np.mean(values)))
        panel.plot(costs, gains, color="black", marker="o", markersize=4, linewidth=1.0,
                   label="best-of-n of the SFT policy (n = 1, 2, 4, ...)")
    panel.set_xscale("symlog", linthresh=10.0)
    _decorate(panel, "training CPU-seconds (process time, every thread; evaluations excluded)",
              "gold gain over the SFT policy", "gold reward against compute, each method at its shipped strength")
    if title:
        figure.suptitle(title, fontsize=10)
    return _save(figure, path)


def _minus(value: float | None, baseline: float) -> float | None:
    return None if value is None else value - baseline


def _decorate(axes, xlabel: str, ylabel: str, title: str) -> None:
    axes.axhline(0.0, color="0.6", linewidth=0.8)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="best")


def _save(figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path
