"""Pictures of a run without W&B: PNG curves of a run folder's main metrics, training and validation.

``python -m rlhf_lightning plot outputs/ppo`` draws them for any run folder; the command line draws them at the end
of every ``fit`` (``<run folder>/plots/<stage>.png``). They are read back from the W&B run files the folder holds
(offline runs, and the local copy of online ones). A run and the runs it resumed are one curve, so that a resumed
run's curves continue its first part's; a folder shared by several fresh runs (a sweep's trials) draws each as its
own curve, in its own colour, the latest marked.

The panels (at most :data:`MAX_PANELS`): each held-out metric beside its training twin (pass@k and maj@k in one
panel, the gold per task in one), gold against KL (over-optimisation at a glance), then the training-only curves
a researcher reads first where they are logged: PPO's ``policy/approx_kl``, ``policy/clipfrac``, ``loss/value``
and ``value/explained_variance``, GRPO's ``objective/frac_zero_std``, the loss and the gradient norm. A series
identical to one already drawn (an arithmetic task's score, which is its gold) is drawn once; shares (``*_frac``,
``frac_*``, ``clipfrac``, accuracies, pass@k) get a 0-1 y-axis. The held-out gold carries its error bar, a shaded
95 % interval of the mean over the held-out samples.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from rlhf_lightning.runs.wandb_offline import has_history, read_config, read_history

# What a panel shows first, by metric name after ``<prefix>/`` (``val/<name>`` beside its training counterpart).
PREFERRED = ("gold", "score", "kl", "loss", "accuracy", "gold_accuracy", "perplexity", "length", "eos_frac",
             "margin", "reverse_kl")
TRAINING_PLACES = ("", "objective/", "response/", "teacher/", "rewards/")  # where a validation name's twin lives
# The training-only curves a researcher reads first, in this order, where logged: the update's size and clipping
# (PPO and the policy-gradient family), the critic (PPO), the groups that carry no signal (GRPO, RLOO), the loss.
TRAINING_ONLY = ("objective/score", "objective/gold", "objective/kl", "policy/approx_kl", "policy/clipfrac",
                 "loss/value", "value/explained_variance", "objective/frac_zero_std", "loss", "loss/total",
                 "accuracy", "grad_norm")
PASS_AT_K = re.compile(r"(pass|maj)@(\d+)")
GROUPS = ("pass@k", "gold per task")  # the panels that hold several held-out metrics
# Validation values that are the scale of another, read in the summary rather than drawn (the gold's spread and
# sample count: drawn as the held-out gold's error bar).
NOT_DRAWN = ("gold_std", "gold_count")
# The error bar of a held-out mean with ``<name>_std`` and ``<name>_count`` logged beside it: a 95 % interval of the
# mean, 1.96 standard errors each side (the same prompts each time, so it overstates the noise between two points).
INTERVAL_Z = 1.96
MAX_PANELS = 12
FRACTION_LIMITS = (-0.02, 1.02)  # a 0-1 axis, with a margin so that points at 0 and 1 show whole


class Panel(NamedTuple):
    """One panel: ``metrics`` against the stage's x-axis, or, with ``against``, each metric against the metric at
    the same place of ``against`` (gold against KL), point by point in the order of the x-axis."""

    title: str
    metrics: list[str]
    against: list[str] | None = None


def is_fraction(key: str) -> bool:
    """Whether the metric is a share in 0-1: ``*_frac``, ``frac_*``, ``clipfrac*``, ``*accuracy``, pass@k, maj@k."""
    name = key.rsplit("/", 1)[-1]
    return (name.endswith("_frac") or name.startswith(("frac_", "clipfrac")) or name.endswith("accuracy")
            or PASS_AT_K.fullmatch(name) is not None)


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


def validation_panels(prefix: str, keys: set[str]) -> tuple[list[Panel], set[str]]:
    """Each validation metric with its training twin (pass@k and maj@k together, the gold per task together), and
    the training keys they show."""
    names = sorted((key.split("/val/", 1)[1] for key in keys if key.startswith(f"{prefix}/val/")
                    and key.split("/val/", 1)[1] not in NOT_DRAWN),
                   key=lambda name: (PREFERRED.index(name) if name in PREFERRED else len(PREFERRED), name))
    chosen: list[Panel] = []
    shown: set[str] = set()
    grouped: dict[str, list[str]] = {}
    for name in names:
        match = PASS_AT_K.fullmatch(name)
        if match or name.startswith("gold/"):  # one panel each: the ks beside each other, the tasks beside each other
            group = GROUPS[0] if match else GROUPS[1]
            if group not in grouped:
                grouped[group] = []
                chosen.append(Panel(group, grouped[group]))
            grouped[group].append(f"{prefix}/val/{name}")
            continue
        twins = [f"{prefix}/{place}{name}" for place in TRAINING_PLACES if f"{prefix}/{place}{name}" in keys][:1]
        chosen.append(Panel(name, [*twins, f"{prefix}/val/{name}"]))
        shown.update(twins)
    if GROUPS[0] in grouped:  # pass@1 2 4 ... then maj@2 4 ...
        grouped[GROUPS[0]].sort(key=lambda key: (key.rsplit("/", 1)[1][:3] == "maj", int(key.rsplit("@", 1)[1])))
    return chosen, shown


def gold_against_kl(prefix: str, keys: set[str]) -> Panel | None:
    """Gold against KL (training and validation, where logged): over-optimisation shows as a curve that bends
    down while the KL grows."""
    pairs = [(f"{prefix}/{place}gold", f"{prefix}/{place}kl") for place in ("objective/", "val/")
             if {f"{prefix}/{place}gold", f"{prefix}/{place}kl"} <= keys]
    return Panel("gold against kl", [gold for gold, _ in pairs], [kl for _, kl in pairs]) if pairs else None


def panels(prefix: str, keys: set[str], runs: Sequence[Sequence[dict[str, float]]] = ()) -> list[Panel]:
    """The panels of a stage: each validation metric with its training twin, gold against KL, then the main
    training-only curves; with the ``runs``' rows, a series identical to one shown before (an arithmetic task's
    score, which is its gold) is left out; at most ``MAX_PANELS``."""
    chosen, shown = validation_panels(prefix, keys)
    versus = gold_against_kl(prefix, keys)
    if versus is not None:  # beside the KL's own panel, else after the held-out ones
        titles = [panel.title for panel in chosen]
        chosen.insert(titles.index("kl") + 1 if "kl" in titles else len(chosen), versus)
    for name in TRAINING_ONLY:
        key = f"{prefix}/{name}"
        if key in keys and key not in shown:
            chosen.append(Panel(name, [key]))
            shown.add(key)
    if runs:
        chosen = without_duplicates(chosen, runs, x_axis(prefix, keys))
    return chosen[:MAX_PANELS]


def without_duplicates(chosen: list[Panel], runs: Sequence[Sequence[dict[str, float]]], x: str) -> list[Panel]:
    """``chosen`` without the series that repeat one drawn in an earlier panel (to 6 significant digits, in every
    run), and without the panels left empty."""
    seen: set[tuple] = set()
    kept = []
    for panel in chosen:
        if panel.against is None and panel.title not in GROUPS:  # a group's curves are read together: all kept
            metrics = []
            for key in panel.metrics:
                drawn = tuple(tuple((x_value, float(f"{y:.6g}")) for x_value, y in zip(*series(rows, x, key),
                                                                                      strict=True))
                              for rows in runs)
                if any(drawn) and drawn in seen:
                    continue
                seen.add(drawn)
                metrics.append(key)
            panel = panel._replace(metrics=metrics)
        if panel.metrics:
            kept.append(panel)
    return kept


def x_axis(prefix: str, keys: set[str]) -> str:
    """The stage's x-axis: ``<prefix>/iteration`` for the on-policy loop, optimizer steps otherwise."""
    return f"{prefix}/iteration" if f"{prefix}/iteration" in keys else "trainer/global_step"


def series(rows: Sequence[dict[str, float]], x: str, key: str) -> tuple[list[float], list[float]]:
    """``key`` against ``x``, sorted by ``x``; a later row at the same ``x`` (a resumed run) replaces the earlier."""
    points = {row[x]: row[key] for row in rows if x in row and key in row}
    xs = sorted(points)
    return xs, [points[value] for value in xs]


def paired(rows: Sequence[dict[str, float]], x: str, against: str, key: str) -> tuple[list[float], list[float]]:
    """``key`` against the metric ``against``, one point per value of ``x`` that logged both, in the order of ``x``."""
    first, second = dict(zip(*series(rows, x, against), strict=True)), dict(zip(*series(rows, x, key), strict=True))
    steps = sorted(first.keys() & second.keys())
    return [first[step] for step in steps], [second[step] for step in steps]


def interval(rows: Sequence[dict[str, float]], x: str, key: str) -> tuple[list[float], list[float]] | None:
    """The half-width of ``key``'s 95 % interval at each of its points (:data:`INTERVAL_Z` standard errors, from the
    ``<key>_std`` and ``<key>_count`` logged with it), or None where they are not logged at every point."""
    xs, _ = series(rows, x, key)
    spread, counts = dict(zip(*series(rows, x, f"{key}_std"), strict=True)), dict(zip(*series(rows, x,
                                                                                            f"{key}_count"),
                                                                                     strict=True))
    if not xs or any(value not in spread or counts.get(value, 0) < 2 for value in xs):
        return None
    return xs, [INTERVAL_Z * spread[value] / math.sqrt(counts[value]) for value in xs]


def plot_run(folder: str | Path, files: list[list[Path]] | None = None) -> list[Path]:
    """Draw ``<folder>/plots/<prefix>.png`` for every stage logged in ``folder``'s W&B runs; returns the files.
    Each run of the folder is its own curve (:func:`runs_of`, or ``files`` when the caller read them). Raises
    ``FileNotFoundError`` when the folder holds no run that logged something."""
    folder = Path(folder)
    runs = [rows for rows in (numeric_rows(parts) for parts in (runs_of(folder) if files is None else files))
            if rows]
    if not runs:
        raise FileNotFoundError(f"{folder}: no W&B run with logged metrics to plot (was W&B disabled?)")
    keys = {key for rows in runs for row in rows for key in row}
    written = []
    for prefix in stage_prefixes([row for rows in runs for row in rows]):
        chosen = panels(prefix, keys, runs)
        if chosen:
            written.append(draw(folder, prefix, chosen, x_axis(prefix, keys), runs))
    return written


def curve_label(panel: Panel, key: str) -> str:
    """A curve's name in its panel's legend: ``training`` or ``validation`` beside a twin, else the metric's name
    (pass@1, pass@4 ...; a task's gold)."""
    if all("/val/" in metric for metric in panel.metrics) and len(panel.metrics) > 1:
        return key.split("/val/", 1)[1]
    return "validation" if "/val/" in key else "training"


EXPLAINED_VARIANCE_FLOOR = -1.05


def draw(folder: Path, prefix: str, chosen: list[Panel], x: str, runs: list[list[dict[str, float]]]) -> Path:
    """One stage's figure: a panel per entry of ``chosen``, every run's curves in each (training, validation)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, nothing opened on screen

    columns = min(3, len(chosen))
    lines = math.ceil(len(chosen) / columns)
    figure = Figure(figsize=(4.2 * columns, 3.2 * lines), layout="constrained")
    axes = figure.subplots(lines, columns, squeeze=False).flatten()
    several = len(runs) > 1
    for ax, panel in zip(axes, chosen, strict=False):
        for number, rows in enumerate(runs, 1):
            latest = number == len(runs)
            for index, key in enumerate(panel.metrics):
                xs, ys = (series(rows, x, key) if panel.against is None
                          else paired(rows, x, panel.against[index], key))
                if not xs:
                    continue
                validation = "/val/" in key
                sparse = validation or len(xs) <= 20  # a marker on each point a reader should see
                part = curve_label(panel, key)
                style = {"marker": "o" if sparse else None, "markersize": 4 if validation else 2.5,
                         "label": part}
                if several:  # a colour per run; validation dashed beside its training twin
                    style.update(color=f"C{(number - 1) % 10}", linestyle="--" if validation else "-",
                                 linewidth=1.8 if latest else 1.0, alpha=1.0 if latest else 0.6,
                                 label=f"run {number}{' (latest)' if latest else ''} {part}")
                if panel.against is not None and not validation:
                    # Noisy training points joined in iteration order are a tangle: points, faint.
                    style.update(linestyle="none", marker=".", markersize=3, alpha=0.4)
                drawn = ax.plot(xs, ys, **style)
                bar = interval(rows, x, key) if validation and panel.against is None else None
                if bar is not None:  # the held-out mean's 95 % interval: a zig-zag inside it is noise
                    half = bar[1]
                    ax.fill_between(xs, [y - h for y, h in zip(ys, half, strict=True)],
                                    [y + h for y, h in zip(ys, half, strict=True)], color=drawn[0].get_color(),
                                    alpha=0.15 if latest else 0.07, linewidth=0,
                                    label=None if several else "95% interval")
        ax.set_title(f"{prefix}/{panel.title}", fontsize=10)
        if panel.against is not None:
            ax.set_xlabel("kl (nats)" if panel.title == "gold against kl" else panel.against[0])
        else:
            ax.set_xlabel(x.split("/", 1)[1] if x.startswith(f"{prefix}/") else "optimizer step")
        if all(is_fraction(key) for key in panel.metrics):
            ax.set_ylim(*FRACTION_LIMITS)
        elif all(key.endswith("explained_variance") for key in panel.metrics):
            # At most 1; the fresh critic's first values (-24) would flatten the rest: below -1 is "no better
            # than the mean", shown at the edge.
            ax.set_ylim(max(ax.get_ylim()[0], EXPLAINED_VARIANCE_FLOOR), 1.05)
        ax.grid(alpha=0.3)
        if (len(panel.metrics) > 1 and not several) or (several and ax is axes[0]):
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
    drawn: dict[str, tuple[list[Path], str]] = {}
    for folder in argv:
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"plot: {folder} is not a run folder (no such directory)")
        runs = runs_of(Path(folder))
        drawn[folder] = plot_run(folder, runs), runs_text(runs)
    for folder, (paths, runs) in drawn.items():
        print(f"{folder}: " + (", ".join(str(path) for path in paths) or "no metric to plot") + runs, file=sys.stdout)


def runs_text(runs: Sequence[Sequence[Path]], shown: int = 6) -> str:
    """`` (3 runs, each its own curve: run 1 offline-run-..., run 3 (latest) ...)`` for a folder of several runs,
    each named by its W&B run folder (its first part's, for a resumed run); empty for one run."""
    if len(runs) < 2:
        return ""
    names = [f"run {number}{' (latest)' if number == len(runs) else ''} {parts[0].parent.name}"
             for number, parts in enumerate(runs, 1)]
    if len(names) > shown:
        names = [*names[:shown - 1], "...", names[-1]]
    return f" ({len(runs)} runs, each its own curve: {', '.join(names)})"
