"""reasoning-gym through the command line, with the shipped configs: each fault is one ``error:`` line (an unknown
task, settings the task rejects, the package missing), and a tiny SFT -> GRPO run logs the held-out accuracy per
task, pass@k and maj@k, and the checker's error count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlhf_lightning.cli import main
from tests.helpers.cli import logged_keys, one_line

REPO = Path(__file__).resolve().parents[2]
SFT = str(REPO / "configs" / "reasoning_gym_sft.yaml")
GRPO = str(REPO / "configs" / "reasoning_gym_grpo.yaml")
TINY = "--model.init_args.base.architecture={model_type: gpt2, n_layer: 1, n_embd: 16, n_head: 2, n_positions: 256}"
QUIET = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
         "--trainer.callbacks=[]", "--trainer.max_steps=1"]


def test_an_unknown_task_is_one_line_naming_the_close_ones(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line(capsys, "fit", "--config", SFT, *QUIET, "--data.init_args.tasks=[basic_arithmetic, leg_countin]")
    assert line == ("error: tasks[1].name: 'leg_countin' is not a reasoning-gym task (close ones: leg_counting, "
                    "letter_counting, rectangle_count)")


def test_settings_the_task_rejects_are_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line(capsys, "fit", "--config", SFT, *QUIET, TINY,
                    "--data.init_args.tasks=[{name: leg_counting, config: {min_animals: 3, max_animals: 2}}]")
    assert line == ("error: tasks[0].config: task 'leg_counting' rejects the settings {'min_animals': 3, "
                    "'max_animals': 2}: max_animals must be >= min_animals")


def test_without_the_package_the_line_names_the_extra(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # an environment without the extra
    line = one_line(capsys, "fit", "--config", GRPO, *QUIET)
    assert line.startswith("error: reasoning-gym is not installed (")
    assert line.endswith("install the extra: pip install -e '.[reasoning-gym]'")


@pytest.mark.slow
def test_a_tiny_sft_then_grpo_run_logs_accuracy_per_task(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    main(["fit", "--config", SFT, *run, TINY, "--trainer.max_steps=4", "--trainer.val_check_interval=2",
          "--data.init_args.size=64", "--data.init_args.val_size=8", "--data.init_args.batch_size=8"])
    assert (tmp_path / "outputs/reasoning_gym/sft/model/config.json").exists()
    main(["fit", "--config", GRPO, *run, "--data.init_args.size=8", "--data.init_args.val_size=16",
          "--data.init_args.batch_size=4", "--data.init_args.val_batch_size=8", "--model.init_args.samples_per_prompt=2",
          "--model.init_args.sampling.max_new_tokens=6", "--model.init_args.pass_at_k={samples: 2, k: [1, 2]}",
          "--trainer.val_check_interval=2"])
    expected = {"grpo/val/gold", "grpo/val/gold/basic_arithmetic", "grpo/val/gold/chain_sum", "grpo/val/pass@2",
                "grpo/val/maj@2", "grpo/val/score", "grpo/objective/gold",
                "grpo/objective/reasoning_gym/checker_errors", "grpo/objective/reasoning_gym/checker_error_rate"}
    assert expected <= logged_keys(tmp_path / "outputs/reasoning_gym/grpo", expected)
