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
from rlhf_lightning.runs.plots import panels, series, x_axis

PPO_KEYS = {"ppo/iteration", "ppo/objective/score", "ppo/objective/gold", "ppo/objective/kl", "ppo/loss/total",
            "ppo/grad_norm", "ppo/response/length", "ppo/response/eos_frac", "ppo/val/gold", "ppo/val/kl",
            "ppo/val/score", "ppo/val/length", "ppo/val/eos_frac", "ppo/lr/policy", "trainer/global_step"}


def test_each_validation_metric_shares_a_panel_with_its_training_twin():
    assert panels("ppo", PPO_KEYS) == [
        ("gold", ["ppo/objective/gold", "ppo/val/gold"]),
        ("score", ["ppo/objective/score", "ppo/val/score"]),
        ("kl", ["ppo/objective/kl", "ppo/val/kl"]),
        ("length", ["ppo/response/length", "ppo/val/length"]),
        ("eos_frac", ["ppo/response/eos_frac", "ppo/val/eos_frac"]),
        ("loss/total", ["ppo/loss/total"]),
        ("grad_norm", ["ppo/grad_norm"]),
    ]
    assert x_axis("ppo", PPO_KEYS) == "ppo/iteration"
    assert x_axis("sft", {"sft/loss", "sft/val/loss", "trainer/global_step"}) == "trainer/global_step"
    assert panels("sft", {"sft/loss", "sft/val/loss", "sft/val/perplexity"}) == [
        ("loss", ["sft/loss", "sft/val/loss"]), ("perplexity", ["sft/val/perplexity"])]


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
    assert capsys.readouterr().out == f"{folder}: {folder / 'plots' / 'toy.png'}\n"
    labels = [line.get_label() for line in drawn[0].axes[0].get_lines()]
    assert labels == ["run 1 training", "run 1 validation", "run 2 (latest) training", "run 2 (latest) validation"]
    assert drawn[0].get_suptitle() == f"{folder} · toy · 2 runs"
