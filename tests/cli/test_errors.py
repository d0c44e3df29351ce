"""What a user sees from the command line: our errors as one line, a YAML error with its file and line, a
checkpoint that does not belong to the config refused or its differences listed, and the step progress bar."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from rlhf_lightning.callbacks.progress import StepRichProgressBar, StepTQDMProgressBar
from rlhf_lightning.callbacks.progress_lines import ProgressLines
from rlhf_lightning.cli import RLHFCLI, main
from rlhf_lightning.cli.errors import TRACEBACK_ENV
from tests.helpers.cli import cli_subprocess, error_lines

REPO = Path(__file__).resolve().parents[2]
BAD_YAML = "model:\n  class_path: rlhf_lightning.SFT\n   init_args: {optimizer: {lr: 1}}\n"


@pytest.mark.parametrize("case", [pytest.param("constructor", marks=pytest.mark.slow), "yaml"])  # slow: the stack
def test_cli_errors_are_one_line_and_exit_non_zero(tmp_path, case):
    if case == "constructor":  # DPO checks beta before loading any model
        result = cli_subprocess(tmp_path, "fit", "--config", str(REPO / "configs" / "dpo.yaml"),
                                "--model.init_args.beta=-1", "--trainer.logger=false")
        expected, code = "error: beta must be > 0, got -1.0.", 1
    else:
        (tmp_path / "bad.yaml").write_text(BAD_YAML)
        result = cli_subprocess(tmp_path, "fit", "--config", "bad.yaml")
        expected = "error: config file bad.yaml line 3, column 13: YAML syntax error: mapping values are not allowed here"
        code = 2
    assert result.returncode == code, result.stderr[-2000:]
    assert error_lines(result.stderr) == [expected]
    assert "Traceback" not in result.stderr and "Union" not in result.stderr


@pytest.mark.parametrize(("argument", "expected"), [
    ("--model.init_args.optimizer.lr=abc", "error: model.init_args.optimizer.lr: Expected a <class 'float'>. Got "
                                           "value: abc"),
    ("--model.init_args.optimizer.schedule=bogus", "error: model.init_args.optimizer.schedule: Expected a "
                                                   "typing.Literal['constant', 'linear', 'cosine']. Got value: bogus"),
    ("--trainer.max_stepz=3", "error: unrecognized arguments: --trainer.max_stepz=3 (did you mean "
                              "--trainer.max_steps, --trainer.max_time or --trainer.min_steps?)"),
])
def test_a_bad_value_is_one_line_not_the_usage_and_the_union_report(capsys, argument, expected):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "sft.yaml"), argument])
    assert exit_info.value.code == 2
    assert error_lines(capsys.readouterr().err) == [expected]


def test_a_misspelled_key_in_a_config_file_names_the_file_line_and_the_close_ones(tmp_path, capsys):
    (tmp_path / "mine.yaml").write_text("seed_everything: 1\ntrainer:\n  devices: 1\n  max_epoch: 2\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "sft.yaml"), "--config", "mine.yaml"])
    assert exit_info.value.code == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: mine.yaml:4: trainer.max_epoch: no such option of fit (did you mean trainer.max_epochs, "
        "trainer.min_epochs or trainer.max_steps?)"]


@pytest.mark.parametrize(("written", "expected"), [
    ("model:\n  init_args:\n    optimizer:\n      lr: abc\n",
     "error: mine.yaml:4: model.init_args.optimizer.lr: Expected a <class 'float'>. Got value: abc"),
    ("model:\n  class_path: rlhf_lightning.SFTT\n",
     "error: mine.yaml:2: model.class_path rlhf_lightning.SFTT: rlhf_lightning has no 'SFTT' (did you mean SFT?)"),
])
def test_a_bad_value_in_a_config_file_is_named_at_its_file_and_line(tmp_path, capsys, written, expected):
    (tmp_path / "mine.yaml").write_text(written)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "sft.yaml"), "--config", "mine.yaml"])
    assert exit_info.value.code == 2
    assert error_lines(capsys.readouterr().err) == [expected]


@pytest.mark.parametrize("written", ["sub/mine.yaml", "./sub/mine.yaml", "absolute"])
@pytest.mark.parametrize(("yaml_text", "expected"), [
    ("model:\n  init_args:\n    betta: 0.1\n",
     "model.init_args.betta: rlhf_lightning.DPO takes no argument 'betta' (did you mean beta?); --model.help "
     "rlhf_lightning.DPO lists them all"),
    ("model:\n  init_args:\n    optimizer:\n      lr: abc\n",
     "model.init_args.optimizer.lr: Expected a <class 'float'>. Got value: abc"),
    ("trainer:\n  max_epoch: 2\n", "trainer.max_epoch: no such option of fit (did you mean trainer.max_epochs, "
                                   "trainer.min_epochs or trainer.max_steps?)"),
], ids=["model-key", "type", "trainer-key"])
def test_a_key_of_a_config_file_in_another_folder_is_named_at_its_file_however_its_path_is_written(
        tmp_path, capsys, written, yaml_text, expected):
    """jsonargparse reads a config file from inside its folder: the file is still found, and shown as written."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mine.yaml").write_text(yaml_text)
    path = str(tmp_path / "sub" / "mine.yaml") if written == "absolute" else written
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "dpo.yaml"), "--config", path])
    assert exit_info.value.code == 2
    line = len(yaml_text.splitlines())
    assert error_lines(capsys.readouterr().err) == [f"error: {path}:{line}: {expected}"]


@pytest.mark.parametrize(("yaml_text", "expected"), [
    ("trainer:\n  max_epoch: 2\n", "error: sub/mine.yaml:2: trainer.max_epoch: no such option (did you mean "
                                   "trainer.max_epochs, trainer.min_epochs or trainer.max_steps?)"),
    ("model:\n  init_args:\n    betta: 0.1\n",
     "error: sub/mine.yaml:3: model.init_args.betta: rlhf_lightning.DPO takes no argument 'betta' (did you mean "
     "beta?); --model.help rlhf_lightning.DPO lists them all"),
], ids=["trainer-key", "model-key"])
def test_print_config_names_a_typo_as_a_fit_does(tmp_path, capsys, yaml_text, expected):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mine.yaml").write_text(yaml_text)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "dpo.yaml"), "--config", "sub/mine.yaml", "--print_config"])
    assert exit_info.value.code == 2
    assert error_lines(capsys.readouterr().err) == [expected]


@pytest.mark.parametrize(("argument", "expected"), [
    ("--model.init_args.optimizer.lr=abc", "error: model.init_args.optimizer.lr: Expected a <class 'float'>. Got "
                                           "value: abc"),
    ("--model.init_args.optimizer={lr: abc}", "error: model.init_args.optimizer.lr: Expected a <class 'float'>. Got "
                                              "value: abc"),
    ("--model.class_path=rlhf_lightning.SFTT", "error: model.class_path rlhf_lightning.SFTT: rlhf_lightning has no "
                                               "'SFTT' (did you mean SFT?)"),
])
def test_a_bad_value_the_command_line_gives_over_a_config_files_is_not_placed_in_the_file(
        tmp_path, capsys, argument, expected):
    (tmp_path / "mine.yaml").write_text("model:\n  class_path: rlhf_lightning.SFT\n  init_args:\n    optimizer:\n"
                                        "      lr: 0.001\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / "configs" / "sft.yaml"), "--config", "mine.yaml", argument])
    assert error_lines(capsys.readouterr().err) == [expected]


def test_the_full_traceback_on_request(monkeypatch, capsys):
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(ValueError, match="beta must be > 0") as error:
        main(["fit", "--config", str(REPO / "configs" / "dpo.yaml"), "--model.init_args.beta=-1",
              "--trainer.logger=false"])
    assert "Does not validate against any of the Union subtypes" in str(error.value)  # jsonargparse's wrapper


def tiny_sft(*overrides: str) -> None:
    main(["fit", "--config", str(REPO / "configs" / "sft.yaml"), "--trainer.logger=false",
          "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
          "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--data.init_args.synthetic_rows=300",
          "--model.init_args.base.architecture={model_type: gpt2, n_layer: 1, n_embd: 16, n_head: 2, n_positions: 64}",
          *overrides])


def test_a_checkpoint_must_match_the_config_class_and_its_differences_are_listed(tmp_path, capsys):
    tiny_sft("--trainer.max_steps=2")
    checkpoint = "outputs/sft/checkpoints/last.ckpt"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "reward.yaml"), "--ckpt_path", checkpoint])
    assert exit_info.value.code == 1
    assert error_lines(capsys.readouterr().err) == [
        f"error: checkpoint {checkpoint} was written by rlhf_lightning.stages.sft.SFT, but this run's model is "
        "rlhf_lightning.stages.reward_model.RewardModel; give a checkpoint of a RewardModel run, or the config of the run "
        "that wrote it"]

    with pytest.warns(UserWarning) as warnings:
        tiny_sft("--trainer.max_steps=3", "--model.init_args.optimizer.lr=1e-3", "--model.init_args.export_dir=other",
                 "--ckpt_path", checkpoint)
    listed = [str(w.message) for w in warnings if "other model arguments" in str(w.message)]
    assert listed == [
        f"checkpoint {checkpoint} was saved with other model arguments than the config; the config's are used "
        "(outputs go where the config says):\n"
        "  model.init_args.optimizer.lr: checkpoint 0.004, config 0.001\n"
        "  model.init_args.export_dir: checkpoint 'model', config 'other'"]
    assert (tmp_path / "outputs/sft/other/config.json").exists()  # the config's export_dir, in the run folder


@pytest.mark.parametrize("terminal", [True, False])
def test_the_cli_counts_steps_in_a_terminal_and_prints_lines_to_a_log(monkeypatch, terminal):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal)
    cli = RLHFCLI(args=["--config", str(REPO / "configs" / "sft.yaml"), "--trainer.logger=false",
                        "--model.init_args.base.architecture={model_type: gpt2, n_layer: 1, n_embd: 16, n_head: 2}"],
                  run=False)
    lines = [c for c in cli.trainer.callbacks if isinstance(c, ProgressLines)]
    if terminal:
        assert isinstance(cli.trainer.progress_bar_callback, StepRichProgressBar | StepTQDMProgressBar)
        assert not lines
    else:
        assert cli.trainer.progress_bar_callback is None and len(lines) == 1


def boring_fit(bar, **limits) -> None:
    trainer = L.Trainer(callbacks=[bar], logger=False, enable_checkpointing=False, enable_model_summary=False,
                        limit_train_batches=2, limit_val_batches=0, **limits)
    trainer.fit(BoringModel())


def test_a_step_bounded_run_shows_steps_of_max_steps():
    bar = StepRichProgressBar()
    boring_fit(bar, max_steps=5)  # three epochs of two batches
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.description.strip(), task.completed, task.total) == ("Steps", 5, 5)

    bar = StepRichProgressBar()
    boring_fit(bar, max_epochs=2)
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.description.strip(), task.completed, task.total) == ("Epoch 2/2", 2, 2)  # counted from 1

    bar = StepTQDMProgressBar()
    boring_fit(bar, max_epochs=3)
    assert (bar.train_progress_bar.desc, bar.train_progress_bar.n) == ("Epoch 3/3: ", 2)

    bar = StepTQDMProgressBar()
    boring_fit(bar, max_steps=5)
    assert (bar.train_progress_bar.desc, bar.train_progress_bar.n, bar.train_progress_bar.total) == ("Steps: ", 5, 5)


def test_a_model_class_switched_on_the_command_line_says_which_arguments_it_dropped(capsys):
    from rlhf_lightning.cli.command_line import RLHFCLI

    with pytest.warns(UserWarning) as caught:
        RLHFCLI(args=["--config", str(REPO / "configs" / "grpo.yaml"), "--model", "rlhf_lightning.PPO",
                      "--trainer.logger=false"], run=False)
    said = [str(w.message) for w in caught if "replaces" in str(w.message)]
    assert said == ["model.class_path rlhf_lightning.PPO replaces the config's rlhf_lightning.GRPO: its init_args "
                    "advantages.scale_rewards is not an argument of PPO and was dropped"]  # GRPO's estimator's field, not GAE's
    with warnings.catch_warnings(record=True) as caught:  # the same class: nothing dropped, nothing said
        warnings.simplefilter("always")
        RLHFCLI(args=["--config", str(REPO / "configs" / "grpo.yaml"), "--trainer.logger=false"], run=False)
    assert not [w for w in caught if "replaces" in str(w.message)]
