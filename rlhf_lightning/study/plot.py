"""The study's figure: gold and proxy reward against d = sqrt(KL), for PPO (left) and best-of-n (right)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from rlhf_lightning.study.best_of_n import BestOfNPoint
from rlhf_lightning.study.gao import GaoFit
from rlhf_lightning.study.runs import Point, RunResult

COLOURS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def plot_study(
    path: str | Path,
    runs: Sequence[RunResult],
    points: Mapping[float, Sequence[Point]],
    baseline: tuple[float, float],
    fits: Mapping[float, GaoFit],
    best_of_n: Sequence[BestOfNPoint] = (),
    best_of_n_fit: GaoFit | None = None,
    fit_min_d: float = 0.0,
    title: str = "",
) -> Path:
    """Write the two-panel figure to ``path`` (PNG) and return the path.

    Args:
        path: where to write it.
        runs: the PPO runs (one colour each).
        points: for each run's ``kl_coef``, the points to draw (evaluation or training points).
        baseline: ``(gold, proxy)`` of the SFT policy; every curve is drawn as the gain over it.
        fits: Gao RL-form fits to draw, by ``kl_coef``.
        best_of_n: the best-of-n curve (right panel; omitted when empty).
        best_of_n_fit: Gao best-of-n-form fit of the best-of-n gold gain.
        fit_min_d: the RL fits used only points with ``d >= fit_min_d``; the curves are dotted below it.
        title: the figure's title.
    """
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    gold0, proxy0 = baseline
    panels = 2 if best_of_n else 1
    figure = Figure(figsize=(6.2 * panels, 4.6), dpi=100, layout="constrained")
    axes = figure.subplots(1, panels, squeeze=False)[0]

    rl = axes[0]
    for index, run in enumerate(runs):
        colour = COLOURS[index % len(COLOURS)]
        series = points[run.kl_coef]
        d = np.array([p.d for p in series])
        rl.scatter(d, [p.gold - gold0 for p in series], s=16, color=colour, alpha=0.8,
                   label=f"gold, kl_coef={run.kl_coef:g}")
        # Hollow markers, not a line: KL does not grow monotonically over a run, so a line in iteration order
        # would zigzag.
        rl.scatter(d, [p.proxy - proxy0 for p in series], s=18, marker="^", facecolors="none",
                   edgecolors=colour, alpha=0.8, label=f"proxy, kl_coef={run.kl_coef:g}")
        fit = fits.get(run.kl_coef)
        if fit is not None:
            grid = np.linspace(0.0, max(d.max(), 1e-3) * 1.02, 300)
            fitted = grid >= fit_min_d
            where = f", d ≥ {fit_min_d:g}" if fit_min_d > 0 else ""
            rl.plot(grid[fitted], fit(grid[fitted]), color=colour, linewidth=2.2,
                    label=f"fit d(α − β ln d){where}: α={fit.alpha:.2f}, β={fit.beta:.2f}, R²={fit.r2:.2f}")
            rl.plot(grid[~fitted], fit(grid[~fitted]), color=colour, linewidth=1.2, linestyle=":")
    _decorate(rl, "PPO against the proxy reward model")

    if best_of_n:
        bon = axes[1]
        d = np.array([p.d for p in best_of_n])
        bon.scatter(d, [p.gold - gold0 for p in best_of_n], s=22, color="black", label="gold")
        bon.plot(d, [p.proxy - proxy0 for p in best_of_n], color="black", linestyle="--", linewidth=1.2,
                 label="proxy")
        for point in best_of_n:
            bon.annotate(f"n={point.n}", (point.d, point.proxy - proxy0), textcoords="offset points",
                         xytext=(2, 4), fontsize=7, color="0.35")
        if best_of_n_fit is not None:
            grid = np.linspace(0.0, d.max() * 1.02, 200)
            bon.plot(grid, best_of_n_fit(grid), color="black", linewidth=2.0,
                     label=f"fit d(α − β d): α={best_of_n_fit.alpha:.2f}, β={best_of_n_fit.beta:.2f}, "
                           f"R²={best_of_n_fit.r2:.2f}")
        _decorate(bon, "best-of-n of the SFT policy, KL = log n − (n−1)/n")
    if title:
        figure.suptitle(title, fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def _decorate(axes, title: str) -> None:
    axes.axhline(0.0, color="0.6", linewidth=0.8)
    axes.set_xlabel("d = √KL(π ‖ π_SFT)   (√nats)")
    axes.set_ylabel("reward gain over the SFT policy")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="best")
