"""Pictures of a run without W&B: PNG curves of a run folder's main metrics, training and validation.

``python -m rlhf_lightning plot outputs/ppo`` draws them for any run folder; the command line draws them at the end
of every ``fit`` (``<run folder>/plots/<stage>.png``). They are read back from the W&B run files the folder holds
(offline runs, and the local copy of online ones). A run and the runs it resumed are one curve, so that a resumed
run's curves continue its first part's; a folder shared by several fresh runs (a sweep's trials) draws each as its
own curve, in its own colour, the latest marked.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from rlhf_lightning.runs.wandb_offline import has_history, read_config, read_history

# What a panel shows first, by metric name after ``<prefix>/`` (``val/<name>`` beside its training counterpart).
PREFERRED = ("gold", "score", "kl", "loss", "accuracy", "gold_accuracy", "perplexity", "length", "eos_frac",
             "margin", "reverse_kl")
TRAINING_PLACES = ("", "objective/", "response/", "teacher/", "rewards/")  # where a validation name's twin lives
TRAINING_ONLY = ("objective/score", "objective/gold", "objective/kl", "loss", "loss/total", "accuracy", "grad_norm")
MAX_PANELS = 9


def resumed(run_file: Path) -> bool:
    """Whether the run of ``run_file`` continued a checkpoint (its command had a ``ckpt_path``)."""
    config = read_config(run_file).get("cli") or {}
    return bool(config.get("ckpt_path"))


def runs_of(folder: Path) -> list[list[Path]]:
    """The runs of ``folder``, oldest first, each as its W&B run files in order: a fresh run that logged something,
    then each run that resumed it (a run whose command had a ``ckpt_path`` continues the one before it)."""
    files = sorted(folder.rglob("run-*.wandb"), key=lambda path: path.stat().st_mtime)
    runs: list[list[Path]] = []
    for path in (path for path in files if has_history(path)):
        if runs and resumed(path):
            runs[-1].append(path)
        else:
            runs.append([path])
    return runs


def run_files(folder: Path) -> list[Path]:
    """The W&B run files of the folder's latest run, oldest first: its first part and the runs that resumed it."""
    runs = runs_of(folder)
    return runs[-1] if runs else []


def numeric_rows(files: Sequence[Path]) -> list[dict[str, float]]:
    """Every logged row of the run files ``files``, in order, with its finite numbers only."""
    rows = []
    for path in files:
        for row in read_history(path):
            rows.append({key: float(value) for key, value in row.items()
                         if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)})
    return rows


def stage_prefixes(rows: Sequence[dict[str, float]]) -> list[str]:
    """The metric prefixes (``ppo``, ``sft``...) of the rows, in the order they first appear."""
    prefixes: dict[str, None] = {}
    for row in rows:
        for key in row:
            head, _, rest = key.partition("/")
            if rest and head != "trainer" and not head.startswith("_"):
                prefixes.setdefault(head)
    return list(prefixes)


def panels(prefix: str, keys: set[str]) -> list[tuple[str, list[str]]]:
    """``(title, [metric keys])`` per panel: each validation metric with its training twin, then the main
    training-only curves; at most ``MAX_PANELS``."""
    validation = sorted((key.split("/val/", 1)[1] for key in keys if key.startswith(f"{prefix}/val/")),
                        key=lambda name: (PREFERRED.index(name) if name in PREFERRED else len(PREFERRED), name))
    chosen: list[tuple[str, list[str]]] = []
    shown: set[str] = set()
    for name in validation:
        twins = [f"{prefix}/{place}{name}" for place in TRAINING_PLACES if f"{prefix}/{place}{name}" in keys][:1]
        chosen.append((name, [*twins, f"{prefix}/val/{name}"]))
        shown.update(twins)
    for name in TRAINING_ONLY:
        key = f"{prefix}/{name}"
        if key in keys and key not in shown:
            chosen.append((name, [key]))
            shown.add(key)
    return chosen[:MAX_PANELS]


def x_axis(prefix: str, keys: set[str]) -> str:
    """The stage's x-axis: ``<prefix>/iteration`` for the on-policy loop, optimizer steps otherwise."""
    return f"{prefix}/iteration" if f"{prefix}/iteration" in keys else "trainer/global_step"


def series(rows: Sequence[dict[str, float]], x: str, key: str) -> tuple[list[float], list[float]]:
    """``key`` against ``x``, sorted by ``x``; a later row at the same ``x`` (a resumed run) replaces the earlier."""
    points = {row[x]: row[key] for row in rows if x in row and key in row}
    xs = sorted(points)
    return xs, [points[value] for value in xs]


def plot_run(folder: str | Path) -> list[Path]:
    """Draw ``<folder>/plots/<prefix>.png`` for every stage logged in ``folder``'s W&B runs; returns the files.
    Each run of the folder is its own curve (:func:`runs_of`). Raises ``FileNotFoundError`` when the folder holds
    no run that logged something."""
    folder = Path(folder)
    runs = [rows for rows in (numeric_rows(files) for files in runs_of(folder)) if rows]
    if not runs:
        raise FileNotFoundError(f"{folder}: no W&B run with logged metrics to plot (was W&B disabled?)")
    keys = {key for rows in runs for row in rows for key in row}
    written = []
    for prefix in stage_prefixes([row for rows in runs for row in rows]):
        chosen = panels(prefix, keys)
        if chosen:
            written.append(draw(folder, prefix, chosen, x_axis(prefix, keys), runs))
    return written


def draw(folder: Path, prefix: str, chosen: list[tuple[str, list[str]]], x: str,
         runs: list[list[dict[str, float]]]) -> Path:
    """One stage's figure: a panel per entry of ``chosen``, every run's curves in each (training, validation)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, nothing opened on screen

    columns = min(3, len(chosen))
    lines = math.ceil(len(chosen) / columns)
    figure = Figure(figsize=(4.2 * columns, 3.2 * lines), layout="constrained")
    axes = figure.subplots(lines, columns, squeeze=False).flatten()
    several = len(runs) > 1
    for ax, (title, metrics) in zip(axes, chosen, strict=False):
        for number, rows in enumerate(runs, 1):
            latest = number == len(runs)
            for key in metrics:
                xs, ys = series(rows, x, key)
                if not xs:
                    continue
                validation = "/val/" in key
                sparse = validation or len(xs) <= 20  # a marker on each point a reader should see
                part = "validation" if validation else "training"
                style = {"marker": "o" if sparse else None, "markersize": 4 if validation else 2.5,
                         "label": part}
                if several:  # a colour per run; validation dashed beside its training twin
                    style.update(color=f"C{(number - 1) % 10}", linestyle="--" if validation else "-",
                                 linewidth=1.8 if latest else 1.0, alpha=1.0 if latest else 0.6,
                                 label=f"run {number}{' (latest)' if latest else ''} {part}")
                ax.plot(xs, ys, **style)
        ax.set_title(f"{prefix}/{title}", fontsize=10)
        ax.set_xlabel(x.split("/", 1)[1] if x.startswith(f"{prefix}/") else "optimizer step")
        ax.grid(alpha=0.3)
        if (len(metrics) > 1 and not several) or (several and ax is axes[0]):
            ax.legend(fontsize=7 if several else 8)
    for ax in axes[len(chosen):]:
        ax.set_visible(False)
    count = f" · {len(runs)} runs" if several else ""
    figure.suptitle(f"{folder} · {prefix}{count}", fontsize=11)
    path = folder / "plots" / f"{prefix}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


def main(argv: Sequence[str]) -> None:
    """``python -m rlhf_lightning plot RUN_FOLDER [RUN_FOLDER ...]``: draw each folder's curves."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m rlhf_lightning plot RUN_FOLDER [RUN_FOLDER ...]\n\n"
              "Draw PNG curves of a run folder's main metrics, training and validation, into RUN_FOLDER/plots/ "
              "(read from the folder's W&B run files, offline or online).")
        return
    drawn: dict[str, list[Path]] = defaultdict(list)
    for folder in argv:
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"plot: {folder} is not a run folder (no such directory)")
        drawn[folder] = plot_run(folder)
    for folder, paths in drawn.items():
        print(f"{folder}: " + (", ".join(str(path) for path in paths) or "no metric to plot"), file=sys.stdout)
