"""The family study's results (see :mod:`rlhf_lightning.study.family`): the finished units read back, the figures,
the matched-KL and compute tables, Gao et al.'s fits, ``family.json``, and the ``summary`` W&B run."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_lightning.study.best_of_n import BestOfNPoint
from rlhf_lightning.study.evaluation import MethodRun
from rlhf_lightning.study.family_units import result_path, units
from rlhf_lightning.study.frontier import (
    compute_table,
    gao_fits,
    markdown_compute_table,
    markdown_table,
    matched_kl_table,
)
from rlhf_lightning.study.methods import BEST_OF_N, METHODS


def load_results(args: argparse.Namespace) -> tuple[list[MethodRun], dict[int, list[BestOfNPoint]], dict[int, float]]:
    runs, curves, seconds = [], {}, {}
    for unit in units(args):
        row = json.loads(result_path(args, unit).read_text())
        if unit.method == BEST_OF_N:
            curves[unit.seed] = [BestOfNPoint(**point) for point in row["curve"]]
            seconds[unit.seed] = float(row["cpu_seconds"])
        else:
            runs.append(MethodRun.from_dict(row))
    return runs, curves, seconds


def analyse(args: argparse.Namespace) -> dict[str, Any]:
    """Figures, table and summary from the finished runs."""
    from rlhf_lightning.study.family_plot import plot_compute, plot_kl

    runs, curves, seconds = load_results(args)
    names = [name for name in args.methods if name in METHODS]
    labels = {name: METHODS[name].label for name in names}
    shipped = {name: METHODS[name].shipped for name in names}
    fits = gao_fits(runs, curves, [name for name in names if METHODS[name].uses_reward_model], args.fit_min_d)
    rows = matched_kl_table(runs, curves, args.kls, labels)
    out = Path(args.out)
    mode = "quick" if args.quick else "full"
    share = "each config's full training" if args.fraction == 1 else f"{args.fraction:g} of each config's training"
    title = f"{len(args.seeds)} seeds of the pipeline ({mode} mode), {args.eval_prompts} held-out prompts, {share}"
    kl_png = plot_kl(out / "kl.png", runs, curves, labels, title)
    compute_png = plot_compute(out / "compute.png", runs, curves, seconds, labels, shipped, title)
    compute_rows = compute_table(runs, curves, seconds, args.budgets, labels, shipped)
    table = markdown_table(rows, args.kls, fits) + "\n\n" + markdown_compute_table(compute_rows, args.budgets)
    (out / "table.md").write_text(table + "\n")
    summary = {"mode": mode, "seeds": args.seeds, "kls": args.kls, "budgets": args.budgets,
               "fraction": args.fraction, "eval_prompts": args.eval_prompts, "group": args.group, "table": rows,
               "compute_table": compute_rows, "gao_fits": fits, "shipped_strengths": shipped,
               "strengths": {name: list(METHODS[name].quick_strengths() if args.quick else METHODS[name].strengths)
                             for name in names},
               "sft": {run.seed: {"gold": run.points[0].gold, "proxy": run.points[0].proxy} for run in runs},
               "figures": [str(kl_png), str(compute_png)], "table_markdown": table}
    (out / "family.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    if args.png_dir:
        target = Path(args.png_dir)
        target.mkdir(parents=True, exist_ok=True)
        for path in (kl_png, compute_png, out / "table.md"):
            (target / f"family_{mode}_{path.name}").write_bytes(path.read_bytes())
    log_summary(args, kl_png, compute_png, rows, compute_rows)
    return summary


def log_summary(args: argparse.Namespace, kl_png: Path, compute_png: Path, rows: Sequence[dict[str, Any]],
                compute_rows: Sequence[dict[str, Any]]) -> None:
    """A ``summary`` run in the study's W&B group: both figures as images and both tables."""
    import wandb

    from rlhf_lightning.cli.loggers import WandbLogger

    logger = WandbLogger(save_dir=args.out, group=args.group, name="summary", tags=["family"])
    columns = ["method", *[f"gold gain at KL {kl:g}" for kl in args.kls], "peak gain", "peak KL"]
    data = [[row["label"], *[_mean(row[f"kl_{kl:g}"]) for kl in args.kls], _mean(row["peak"]),
             _mean(row["peak_kl"])] for row in rows]
    logger.experiment.log({
        "study/family_kl": wandb.Image(str(kl_png), caption="gold and proxy gain against sqrt(KL)"),
        "study/family_compute": wandb.Image(str(compute_png), caption="gold gain against CPU-seconds"),
        "study/family_table": wandb.Table(columns=columns, data=data),
        "study/family_compute_table": wandb.Table(
            columns=["method", *[f"gold gain after {b:g} CPU-s" for b in args.budgets]],
            data=[[row["label"], *[_mean(row[f"cpu_{b:g}"]) for b in args.budgets]] for row in compute_rows]),
    })
    logger.finalize("success")


def _mean(cell: dict[str, Any] | None) -> float | None:
    return None if cell is None else cell["mean"]
