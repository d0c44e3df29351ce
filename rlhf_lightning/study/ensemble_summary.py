"""The ensemble study's numbers (see :mod:`rlhf_lightning.study.ensembles`): best-of-n and PPO tables over seeds,
and their two figures."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlhf_lightning.runs.wandb_offline import read_history
from rlhf_lightning.study.pipeline_runs import Pipeline, Sample
from rlhf_lightning.study.plot import COLOURS

LABELS = {"single": "one reward model", "mean": "mean", "min": "worst case (WCO)", "uwo": "UWO"}


def spread(values: Sequence[float], digits: int = 2, sign: str = "+") -> str:
    """``mean ± sample SD`` (the value alone for one), the mean with its sign unless ``sign`` is ``""``."""
    if len(values) == 1:
        return f"{values[0]:{sign}.{digits}f}"
    return f"{statistics.mean(values):{sign}.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def best_of_n_table(bon: Sequence[dict], noise: float,
                    member_data: str) -> tuple[list[str], dict[str, np.ndarray]]:
    """Markdown rows of best-of-n at ``noise`` with members trained on ``member_data``: each rule's gold gain over the
    SFT policy (n = 1) at some n, its peak and what is lost from the peak at the largest n, mean ± SD over seeds; and
    each rule's gains ``[seeds, ns]``."""
    runs = [b for b in bon if (b["noise"], b["member_data"]) == (noise, member_data)]
    ns = [p["n"] for p in runs[0]["curves"]["single"]]
    shown = [n for n in ns if n in (4, 16, ns[-1])]
    lines = [f"| rule | {' | '.join(f'gold gain, n = {n}' for n in shown)} | peak (n) | largest n less peak |",
             f"|---|{'---|' * len(shown)}---|---|"]
    gains = {}
    for rule in LABELS:
        gain = np.array([[p["gold"] - run["curves"]["single"][0]["gold"] for p in run["curves"][rule]] for run in runs])
        gains[rule] = gain
        peak_n = [ns[int(np.argmax(row))] for row in gain]
        lines.append(f"| {LABELS[rule]} | {' | '.join(spread(list(gain[:, ns.index(n)])) for n in shown)} "
                     f"| {spread(list(gain.max(1)))} ({', '.join(map(str, peak_n))}) "
                     f"| {spread(list(gain[:, -1] - gain.max(1)))} |")
    return lines, gains


def ppo_trajectories(runs: Pipeline, stage: str, samples: Sequence[Sample]) -> list[dict[str, list[float]]]:
    """Each sample's held-out evaluations of one PPO run: iteration, gold, KL and proxy score."""
    out = []
    for sample in samples:
        rows = [row for row in read_history(runs.folder(stage, sample)) if "ppo/val/gold" in row]
        out.append({key: [float(row[name]) for row in rows] for key, name in
                    (("iteration", "ppo/iteration"), ("gold", "ppo/val/gold"), ("kl", "ppo/val/kl"),
                     ("proxy", "ppo/val/score"), ("gold_sd", "ppo/val/gold_std"))})
    return out


def ppo_table(trajectories: dict[str, list[dict[str, list[float]]]]) -> list[str]:
    """Markdown rows of the PPO runs: the held-out gold gain at its peak and at the end, the drop between them, the
    final KL and proxy gain, mean ± SD over seeds."""
    lines = ["| reward, KL coefficient | gold gain at its peak | at the end | end less peak | KL at the end (nats) "
             "| proxy gain at the end |", "|---|---|---|---|---|---|"]
    for name, runs in trajectories.items():
        rule, kl = name.removeprefix("ppo-").split(":")
        gain = [np.array(run["gold"]) - run["gold"][0] for run in runs]
        lines.append(f"| {LABELS[rule]}, {kl} | {spread([g.max() for g in gain])} | {spread([g[-1] for g in gain])} "
                     f"| {spread([g[-1] - g.max() for g in gain])} | {spread([run['kl'][-1] for run in runs], 1, '')} "
                     f"| {spread([run['proxy'][-1] - run['proxy'][0] for run in runs])} |")
    return lines


def plot(path: Path, gains: dict[str, dict[str, np.ndarray]], kls: Sequence[float],
         trajectories: dict[str, list[dict[str, list[float]]]]) -> Path:
    """Best-of-n (a panel per ensemble, titled by its label noise and data: gold gain against sqrt(KL)) and PPO
    (gold gain against iterations), mean and ± SD band over seeds."""
    from matplotlib.figure import Figure

    panels = len(gains) + (1 if trajectories else 0)
    figure = Figure(figsize=(5.2 * panels, 4.2), dpi=100, layout="constrained")
    axes = figure.subplots(1, panels, squeeze=False)[0]
    d = np.sqrt(np.asarray(kls))
    for axis, (title, by_rule) in zip(axes, gains.items(), strict=False):
        for index, (rule, gain) in enumerate(by_rule.items()):
            mean, sd = gain.mean(0), gain.std(0, ddof=1) if len(gain) > 1 else np.zeros(gain.shape[1])
            axis.plot(d, mean, "-o", ms=3, color=COLOURS[index], label=LABELS[rule])
            axis.fill_between(d, mean - sd, mean + sd, color=COLOURS[index], alpha=0.15)
        axis.set(title=f"best-of-n, {title}", xlabel="sqrt(KL) (nats^1/2)",
                 ylabel="gold gain over the SFT policy")
        axis.legend(fontsize=8)
    if trajectories:
        axis = axes[-1]
        for index, (name, runs) in enumerate(trajectories.items()):
            length = min(len(run["gold"]) for run in runs)
            gain = np.array([np.array(run["gold"][:length]) - run["gold"][0] for run in runs])
            mean, sd = gain.mean(0), gain.std(0, ddof=1) if len(gain) > 1 else np.zeros(length)
            rule, kl = name.removeprefix("ppo-").split(":")
            iterations = runs[0]["iteration"][:length]
            axis.plot(iterations, mean, "-o", ms=3, color=COLOURS[index], label=f"{LABELS[rule]}, KL coef {kl}")
            axis.fill_between(iterations, mean - sd, mean + sd, color=COLOURS[index], alpha=0.15)
        axis.set(title="PPO, held-out gold", xlabel="iteration", ylabel="gold gain over the SFT policy")
        axis.legend(fontsize=8)
    figure.savefig(path)
    return path


def summarise(args: argparse.Namespace, runs: Pipeline, samples: Sequence[Sample], bon: Sequence[dict],
              ppo: Sequence[str]) -> dict[str, Any]:
    """Print and write the tables (``ensembles.md``), the figure (``ensembles.png``) and everything measured
    (``ensembles.json``) under ``--out``."""
    out = Path(args.out)
    lines, gains = [], {}
    for noise in args.label_noise:
        for member_data in args.member_data:
            title = f"{noise:.0%} of labels flipped" + ("" if member_data == "shared" else f", {member_data} data")
            table, gains[title] = best_of_n_table(bon, noise, member_data)
            lines += [f"Best-of-n, {title}, {args.members} members, UWO lambda {args.uwo_coef:g}:", "", *table, ""]
    trajectories = {stage: ppo_trajectories(runs, stage, samples) for stage in ppo}
    if trajectories:
        lines += [f"PPO, {args.ppo_noise:.0%} of labels flipped (held-out gold every {args.eval_every} iterations):",
                  "", *ppo_table(trajectories), ""]
    text = "\n".join(lines)
    print(text)
    (out / "ensembles.md").write_text(text)
    kls = [p["kl"] for p in bon[0]["curves"]["single"]]
    figure = plot(out / "ensembles.png", gains, kls, trajectories)
    if args.png_dir:
        Path(args.png_dir, "ensembles.png").write_bytes(figure.read_bytes())
    result = {"best_of_n": list(bon), "ppo": trajectories, "table": text}
    (out / "ensembles.json").write_text(json.dumps(result, indent=1))
    return result
