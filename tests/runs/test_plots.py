"""PNG curves of a run folder, readable without W&B: which curves, on which x-axis, from every run of the folder
(each its own curve; a resumed run continues the one it resumed)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from matplotlib.image import imread

from rlhf_lightning.cli import main
from rlhf_lightning.cli.loggers import WandbLogger
from rlhf_lightning.runs.plots import (
    FRACTION_LIMITS,
    MAX_PANELS,
    Panel,
    draw,
    is_fraction,
    panels,
    series,
    x_axis,
)

PPO_KEYS = {"ppo/iteration", "ppo/objective/score", "ppo/objective/gold", "ppo/objective/kl", "ppo/loss/total",
            "ppo/grad_norm", "ppo/response/length", "ppo/response/eos_frac", "ppo/val/gold", "ppo/val/kl",
            "ppo/val/score", "ppo/val/length", "ppo/val/eos_frac", "ppo/lr/policy", "trainer/global_step",
            "ppo/policy/approx_kl", "ppo/policy/clipfrac", "ppo/loss/value", "ppo/value/explained_variance",
            "ppo/loss/policy", "ppo/value/clipfrac", "ppo/time/iteration"}


def test_each_validation_metric_shares_a_panel_with_its_training_twin_and_ppo_shows_its_update():
    assert panels("ppo", PPO_KEYS) == [
        Panel("gold", ["ppo/objective/gold", "ppo/val/gold"]),
        Panel("score", ["ppo/objective/score", "ppo/val/score"]),
        Panel("kl", ["ppo/objective/kl", "ppo/val/kl"]),
        Panel("gold against kl", ["ppo/objective/gold", "ppo/val/gold"], ["ppo/objective/kl", "ppo/val/kl"]),
        Panel("length", ["ppo/response/length", "ppo/val/length"]),
        Panel("eos_frac", ["ppo/response/eos_frac", "ppo/val/eos_frac"]),
        Panel("policy/approx_kl", ["ppo/policy/approx_kl"]),
        Panel("policy/clipfrac", ["ppo/policy/clipfrac"]),
        Panel("loss/value", ["ppo/loss/value"]),
        Panel("value/explained_variance", ["ppo/value/explained_variance"]),
        Panel("loss/total", ["ppo/loss/total"]),
        Panel("grad_norm", ["ppo/grad_norm"]),
    ]
    assert len(panels("ppo", PPO_KEYS | {"ppo/val/pass@1", "ppo/objective/frac_zero_std"})) == MAX_PANELS == 12
    assert x_axis("ppo", PPO_KEYS) == "ppo/iteration"
    assert x_axis("sft", {"sft/loss", "sft/val/loss", "trainer/global_step"}) == "trainer/global_step"
    assert panels("sft", {"sft/loss", "sft/val/loss", "sft/val/perplexity"}) == [
        ("loss", ["sft/loss", "sft/val/loss"], None), ("perplexity", ["sft/val/perplexity"], None)]
    assert panels("grpo", {"grpo/val/gold", "grpo/val/gold/sums", "grpo/val/gold/products"}) == [
        Panel("gold", ["grpo/val/gold"]), Panel("gold per task", ["grpo/val/gold/products", "grpo/val/gold/sums"])]
    # Training alone (no validation ran): gold against KL from the rollouts' own values.
    assert panels("ppo", {"ppo/objective/gold", "ppo/objective/kl"}) == [
        Panel("gold against kl", ["ppo/objective/gold"], ["ppo/objective/kl"]),
        Panel("objective/gold", ["ppo/objective/gold"]), Panel("objective/kl", ["ppo/objective/kl"])]


def arithmetic_grpo_rows() -> list[dict[str, float]]:
    """What an arithmetic GRPO run logs: the reward is the task's checker, so score and gold are the same numbers
    (to float rounding); pass@k and maj@k on the held-out problems; the share of groups that all scored alike."""
    rows = []
    for i in range(1, 9):
        solved = 0.1 + 0.05 * i
        rows.append({"grpo/iteration": i, "grpo/objective/gold": solved, "grpo/objective/score": solved + 1e-9,
                     "grpo/objective/kl": 0.1 * i, "grpo/objective/frac_zero_std": 0.9 - 0.05 * i,
                     "grpo/policy/approx_kl": 0.01, "grpo/policy/clipfrac": 0.02, "grpo/loss/total": -0.1,
                     "grpo/grad_norm": 1.0})
        if i % 4 == 0:
            rows.append({"grpo/iteration": i, "grpo/val/gold": solved, "grpo/val/score": solved,
                         "grpo/val/kl": 0.1 * i, "grpo/val/pass@1": solved, "grpo/val/pass@4": 2 * solved,
                         "grpo/val/maj@4": 1.5 * solved, "grpo/val/pass@2": 1.5 * solved,
                         "grpo/val/eos_frac": 1.0})
    return rows


def test_grpo_draws_gold_once_the_passes_together_and_its_zero_std_groups():
    rows = arithmetic_grpo_rows()
    keys = {key for row in rows for key in row}
    chosen = panels("grpo", keys, [rows])  # pass@1 repeats val/gold here, maj@4 pass@2: a group keeps them all
    assert [panel.title for panel in chosen] == [
        "gold", "kl", "gold against kl", "eos_frac", "pass@k", "policy/approx_kl", "policy/clipfrac",
        "objective/frac_zero_std", "loss/total", "grad_norm"]  # no "score": the same curves as gold
    assert chosen[4].metrics == ["grpo/val/pass@1", "grpo/val/pass@2", "grpo/val/pass@4", "grpo/val/maj@4"]
    # Without the rows (keys alone) nothing can be known to repeat: score keeps its panel.
    assert "score" in [panel.title for panel in panels("grpo", keys)]
    # A score that differs from the gold (a learned reward model) keeps its panel.
    learned = [{**row, "grpo/objective/score": row["grpo/objective/score"] * 3} if "grpo/objective/score" in row
               else row for row in rows]
    assert [panel.title for panel in panels("grpo", keys, [learned])][:2] == ["gold", "score"]


def test_shares_are_drawn_on_a_zero_to_one_axis_and_gold_against_kl(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    assert [is_fraction(name) for name in ("grpo/objective/frac_zero_std", "ppo/response/eos_frac",
                                           "ppo/policy/clipfrac", "rm/val/gold_accuracy", "grpo/val/pass@4",
                                           "grpo/val/maj@2", "ppo/objective/kl", "ppo/policy/approx_kl")] == [
        True, True, True, True, True, True, False, False]
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, *args, **kwargs: drawn.append(figure))
    rows = arithmetic_grpo_rows()
    chosen = panels("grpo", {key for row in rows for key in row}, [rows])
    draw(tmp_path, "grpo", chosen, "grpo/iteration", [rows])
    axes = {ax.get_title(): ax for ax in drawn[0].axes if ax.get_visible()}
    assert [title for title, ax in axes.items() if ax.get_ylim() == FRACTION_LIMITS] == [
        "grpo/eos_frac", "grpo/pass@k", "grpo/policy/clipfrac", "grpo/objective/frac_zero_std"]
    assert [line.get_label() for line in axes["grpo/pass@k"].get_lines()] == ["pass@1", "pass@2", "pass@4",
                                                                              "maj@4"]
    versus = axes["grpo/gold against kl"]
    assert versus.get_xlabel() == "kl (nats)"
    training, validation = versus.get_lines()
    assert list(training.get_xdata()) == pytest.approx([0.1 * i for i in range(1, 9)])
    assert list(training.get_ydata()) == pytest.approx([0.1 + 0.05 * i for i in range(1, 9)])
    assert list(validation.get_xdata()) == pytest.approx([0.4, 0.8])
    assert (training.get_label(), validation.get_label()) == ("training", "validation")
    # Noisy training points are points (joined in iteration order they were a tangle); validation a line.
    assert (training.get_linestyle(), training.get_marker()) == ("None", ".")
    assert validation.get_linestyle() == "-"


def test_explained_variance_is_drawn_from_minus_one_to_one(tmp_path, monkeypatch):
    """A fresh critic's first explained variance (-24 in the quick start) would flatten the curve that matters."""
    from matplotlib.figure import Figure

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, *args, **kwargs: drawn.append(figure))
    rows = [{"ppo/iteration": float(i), "ppo/value/explained_variance": value}
            for i, value in enumerate([-24.0, -3.0, 0.1, 0.4, 0.5], 1)]
    draw(tmp_path, "ppo", panels("ppo", {key for row in rows for key in row}, [rows]), "ppo/iteration", [rows])
    (ax,) = [ax for ax in drawn[0].axes if ax.get_visible()]
    assert ax.get_title() == "ppo/value/explained_variance" and ax.get_ylim() == (-1.05, 1.05)


def test_a_resumed_run_continues_the_curve():
    rows = [{"x": 1, "y": 1.0}, {"x": 2, "y": 2.0}, {"x": 3, "y": 3.0},  # killed after 3, resumed from 2
            {"x": 3, "y": 3.5}, {"x": 4, "y": 4.0}, {"x": 5}]
    assert series(rows, "x", "y") == ([1, 2, 3, 4], [1.0, 2.0, 3.5, 4.0])


class Toy(BoringModel):
    """BoringModel logging a training and a validation loss under the prefix ``toy``."""

    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        self.log("toy/loss", output["loss"])
        return output

    def validation_step(self, batch, batch_idx):
        self.log("toy/val/loss", self.step(batch))


def test_the_plot_command_draws_a_run_folder(tmp_path, capsys):
    torch.manual_seed(0)
    folder = tmp_path / "run"
    logger = WandbLogger(save_dir=str(folder), offline=True)
    trainer = L.Trainer(max_steps=8, limit_train_batches=4, limit_val_batches=2, log_every_n_steps=1, logger=logger,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=folder)
    trainer.fit(Toy())
    main(["plot", str(folder)])
    assert capsys.readouterr().out == f"{folder}: {folder / 'plots' / 'toy.png'}\n"
    image = imread(folder / "plots" / "toy.png")
    assert image.shape[:2] == (320, 420)  # one panel: the loss, training and validation, at 100 dpi


def test_the_plot_command_names_what_is_missing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_status:
        main(["plot", str(tmp_path / "nowhere")])
    assert exit_status.value.code == 1
    assert capsys.readouterr().err == f"error: plot: {tmp_path / 'nowhere'} is not a run folder (no such directory)\n"
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path)])
    assert capsys.readouterr().err == (f"error: {tmp_path}: no W&B run with logged metrics to plot (was W&B "
                                       "disabled?)\n")


def toy_run(folder, ckpt_path=None, seed=0) -> None:
    """A Toy fit logging to an offline W&B run in ``folder``, its config recording ``ckpt_path`` as the CLI's does."""
    torch.manual_seed(seed)
    logger = WandbLogger(save_dir=str(folder), offline=True)
    logger.experiment.config.update({"cli": {"ckpt_path": ckpt_path}})
    trainer = L.Trainer(max_steps=4, limit_train_batches=4, limit_val_batches=1, log_every_n_steps=1, logger=logger,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=folder)
    trainer.fit(Toy())


def test_a_folder_shared_by_fresh_runs_draws_each_run_and_what_resumed_it(tmp_path, capsys, monkeypatch):
    from rlhf_lightning.runs.plots import numeric_rows, run_files, runs_of

    folder = tmp_path / "sweep"
    toy_run(folder)  # a first trial
    first = set(folder.rglob("run-*.wandb"))
    toy_run(folder, seed=1)  # a second, fresh: the first is not part of it
    second = set(folder.rglob("run-*.wandb")) - first
    assert run_files(folder) == sorted(second)
    toy_run(folder, ckpt_path="last", seed=2)  # the second trial resumed
    third = set(folder.rglob("run-*.wandb")) - first - second
    assert runs_of(folder) == [sorted(first), [*second, *third]]
    assert run_files(folder) == [*second, *third]
    # Each run is its own curve: the picture's first panel has one training and one validation line per run, and
    # the trials' own numbers (different seeds) are drawn, not the latest twice.
    losses = [[row["toy/loss"] for row in numeric_rows(files) if "toy/loss" in row] for files in runs_of(folder)]
    assert losses[0] != losses[1][:len(losses[0])]
    from matplotlib.figure import Figure

    drawn = []
    original = Figure.savefig

    def keep(figure, *args, **kwargs):  # the figure as drawn, to read its lines back
        drawn.append(figure)
        return original(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    main(["plot", str(folder)])
    names = [files[0].parent.name for files in runs_of(folder)]
    assert capsys.readouterr().out == (f"{folder}: {folder / 'plots' / 'toy.png'} (2 runs, each its own curve: "
                                       f"run 1 {names[0]}, run 2 (latest) {names[1]})\n")
    labels = [line.get_label() for line in drawn[0].axes[0].get_lines()]
    assert labels == ["run 1 training", "run 1 validation", "run 2 (latest) training", "run 2 (latest) validation"]
    assert drawn[0].get_suptitle() == f"{folder} · toy · 2 runs"


def test_the_plot_line_names_the_runs_of_a_shared_folder():
    from pathlib import Path

    from rlhf_lightning.runs.plots import runs_text

    runs = [[Path(f"sweep/wandb/offline-run-{i}/run-{i}.wandb")] for i in range(1, 9)]
    assert runs_text(runs[:1]) == ""
    assert runs_text(runs[:2]) == " (2 runs, each its own curve: run 1 offline-run-1, run 2 (latest) offline-run-2)"
    assert runs_text(runs) == (" (8 runs, each its own curve: run 1 offline-run-1, run 2 offline-run-2, run 3 "
                               "offline-run-3, run 4 offline-run-4, run 5 offline-run-5, ..., run 8 (latest) "
                               "offline-run-8)")


def test_the_held_out_gold_carries_its_95_percent_interval(tmp_path, monkeypatch):
    """``<prefix>/val/gold_std`` and ``gold_count`` logged beside the held-out gold: a shaded band of 1.96 standard
    errors each side of each point, and neither drawn as a curve of its own."""
    from matplotlib.figure import Figure

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, *args, **kwargs: drawn.append(figure))
    rows = [{"ppo/iteration": float(i), "ppo/val/gold": 0.5 * i, "ppo/val/gold_std": 0.8, "ppo/val/gold_count": 64.0}
            for i in (0, 8, 16)]
    rows += [{"ppo/iteration": float(i), "ppo/objective/gold": 0.1 * i} for i in range(1, 17)]
    chosen = panels("ppo", {key for row in rows for key in row}, [rows])
    assert chosen[0] == Panel("gold", ["ppo/objective/gold", "ppo/val/gold"])
    assert not any("gold_std" in key or "gold_count" in key for panel in chosen for key in panel.metrics)
    draw(tmp_path, "ppo", chosen, "ppo/iteration", [rows])
    gold = next(ax for ax in drawn[0].axes if ax.get_title() == "ppo/gold")
    (band,) = gold.collections
    assert band.get_label() == "95% interval"
    lows_and_highs = band.get_paths()[0].vertices[:, 1]
    half = 1.96 * 0.8 / 8
    assert min(lows_and_highs) == pytest.approx(0.0 - half) and max(lows_and_highs) == pytest.approx(8.0 + half)
    # Without a count (runs logged before it was), no band.
    drawn.clear()
    draw(tmp_path, "ppo", chosen, "ppo/iteration", [[{k: v for k, v in row.items() if k != "ppo/val/gold_count"}
                                                      for row in rows]])
    assert not next(ax for ax in drawn[0].axes if ax.get_title() == "ppo/gold").collections
