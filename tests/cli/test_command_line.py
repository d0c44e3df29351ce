"""The command line: every config parses, --help documents arguments, overrides reach the module, and a
tiny end-to-end SFT -> reward run writes its exports and logs every term to an offline W&B run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlhf_lightning.cli import RLHFCLI, main
from rlhf_lightning.runs.wandb_offline import find_run_file, read_config, read_history
from tests.helpers.cli import grpo, logged_keys

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_there_are_configs_for_every_stage():
    assert {path.stem for path in CONFIGS} >= {"sft", "reward"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_every_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path: rlhf_lightning." in printed and "trainer:" in printed


def test_help_shows_the_docstrings(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / "configs" / "reward.yaml"), "--model.help", "rlhf_lightning.RewardModel"])
    printed = capsys.readouterr().out
    assert "center_coef" in printed and "reward-centering" in printed


def test_overrides_reach_the_instantiated_module():
    cli = RLHFCLI(
        args=["--config", str(REPO / "configs" / "sft.yaml"), "--model.init_args.optimizer.lr=3e-4",
              "--model.init_args.base.architecture={model_type: gpt2, n_layer: 1, n_embd: 16, n_head: 2}",
              "--data.init_args.batch_size=5", "--trainer.logger=false"],
        run=False,
    )
    assert cli.model.optimizer_settings.lr == cli.model.hparams["optimizer"]["lr"] == 3e-4
    assert cli.model.model is None  # built when a fit starts (configure_model), not by the CLI
    cli.model.configure_model()
    assert cli.model.model.hf_model.config.n_layer == 1
    assert cli.datamodule.batch_size == 5


@pytest.mark.parametrize("given", [["--model.init_args.kl.target=null"], ["--model.init_args.kl.target", "null"]])
def test_a_group_field_given_null_on_the_command_line_is_null_and_the_groups_other_fields_stay(given):
    """jsonargparse refuses ``--model.init_args.kl.target=null`` inside a class's init_args; the CLI passes it
    as ``{target: null}``, merged into the config's ``kl``."""
    cli = RLHFCLI(args=["--config", str(REPO / "configs" / "ppo.yaml"), "--model.init_args.kl.target=1.0", *given,
                        "--model.init_args.sampling.stop_token=null", "--trainer.logger=false"], run=False)
    assert cli.model.kl.target is None and cli.model.sampling.stop_token is None
    assert cli.model.kl.coef == 0.07 and cli.model.sampling.max_new_tokens > 1  # the config's, kept


def test_the_word_none_is_a_value_where_the_group_field_takes_it_and_null_elsewhere():
    """``correction.mode=none`` (a mode named ``none``) stays the word; ``kl.target=none`` is null, as before."""
    cli = RLHFCLI(args=["--config", str(REPO / "configs" / "arithmetic_grpo_async.yaml"),
                        "--model.init_args.correction.mode=none", "--model.init_args.kl.target=none",
                        "--model.init_args.engine=rlhf_lightning.rollout.engines.Auto",
                        "--model.init_args.asynchronous.max_staleness=0",
                        "--trainer.logger=false"], run=False)
    assert cli.model.correction.mode == "none" and cli.model.correction.max_weight == 3.0  # the config's bound kept
    assert cli.model.kl.target is None


def _fit(config: str, *overrides: str) -> None:
    main(["fit", "--config", str(REPO / "configs" / config), "--trainer.enable_progress_bar=false",
          "--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=1", *overrides])


@pytest.mark.slow
def test_tiny_sft_then_reward_run_end_to_end_with_wandb_logs(tmp_path, capsys):
    tiny = "{model_type: gpt2, n_layer: 1, n_embd: 16, n_head: 2, n_positions: 64}"
    _fit("sft.yaml", "--trainer.max_steps=6", "--trainer.val_check_interval=3",
         f"--model.init_args.base.architecture={tiny}", "--data.init_args.synthetic_rows=400")
    assert (tmp_path / "outputs/sft/model/config.json").exists()
    assert (tmp_path / "outputs/sft/checkpoints/last.ckpt").exists()
    _fit("reward.yaml", "--trainer.max_steps=6", "--trainer.val_check_interval=3",
         "--data.init_args.synthetic_rows=400", "--model.init_args.lora={r: 2, alpha: 4}")
    export = tmp_path / "outputs/reward/adapters/reward"
    assert {"adapter_config.json", "adapter_model.safetensors", "head.safetensors", "reward_stats.json"} <= {
        path.name for path in export.iterdir()}

    sft_keys = {"sft/loss", "sft/lr", "sft/tokens", "sft/val/loss", "sft/val/perplexity"}
    assert sft_keys <= logged_keys(tmp_path / "outputs/sft", sft_keys)
    # the x-axis: the starting model's validation at step 0, then after steps 3 and 6; a batch's loss before its step
    history = read_history(tmp_path / "outputs/sft")
    assert [row["trainer/global_step"] for row in history if "sft/val/loss" in row] == [0, 3, 6]
    assert [row["trainer/global_step"] for row in history if "sft/loss" in row] == [0, 1, 2, 3, 4, 5]
    reward_keys = {"rm/loss", "rm/accuracy", "rm/margin", "rm/reward_mean", "rm/reward_std", "rm/lr",
                   "rm/val/loss", "rm/val/accuracy", "rm/val/margin", "rm/val/reward_mean", "rm/val/reward_std",
                   "rm/val/gold_accuracy"}
    assert reward_keys <= logged_keys(tmp_path / "outputs/reward", reward_keys)
    # Each fit ends by drawing its run folder's curves, and says where.
    out = capsys.readouterr().out
    for stage, prefix in (("sft", "sft"), ("reward", "rm")):
        assert f"  plots: outputs/{stage}/plots/{prefix}.png\n" in out
        assert (tmp_path / f"outputs/{stage}/plots/{prefix}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The exports carry a model card of the run, not peft's empty template.
    card = (tmp_path / "outputs/reward/adapters/README.md").read_text()
    assert "More Information Needed" not in card
    assert "- **Stage**: `rlhf_lightning.RewardModel`, 6 batches, 6 optimizer steps\n" in card
    assert "adapters here: `reward/`" in card and "- **Data**: `rlhf_lightning.PreferenceDataModule` (" in card
    assert f"- **Command**: `python -m rlhf_lightning fit --config {REPO / 'configs/reward.yaml'} " in card
    assert re.search(r"- \*\*Result\*\* \(the last validation\): rm/val/accuracy [\d.]+ · ", card)
    assert re.search(r"- \*\*Change from the untrained head \(its validation before the first step\)\*\*: "
                     r"rm/val/accuracy [\d.]+ → [\d.]+ · ", card)  # a reward model has no starting policy
    assert "- **Stage**: `rlhf_lightning.SFT`, 6 batches" in (tmp_path / "outputs/sft/model/README.md").read_text()
    config = read_config(find_run_file(tmp_path / "outputs/reward"))["cli"]
    assert config["model"]["class_path"] == "rlhf_lightning.RewardModel"
    assert config["model"]["init_args"]["lora"]["r"] == 2



def test_checkpointing_off_leaves_the_configs_checkpoint_callbacks_out_with_a_warning(tiny_model_dir, reward_dir,
                                                                                      tmp_path):
    """``--trainer.enable_checkpointing=false`` on a shipped config (which lists a checkpoint callback): Lightning
    would refuse the pair with a traceback; the run goes on without a checkpoint, and says so."""
    arguments = [argument for argument in grpo(tiny_model_dir, reward_dir, f"--trainer.default_root_dir={tmp_path}")
                 if argument != "--trainer.callbacks=[]"]  # the config's own: IterationCheckpoint, CompletionsTable
    with pytest.warns(UserWarning, match=r"^trainer.enable_checkpointing=false: the config's checkpoint callbacks "
                                         r"\(IterationCheckpoint\) are left out; this run writes no checkpoint$"):
        main(arguments)
    assert (tmp_path / "config.yaml").is_file() and not (tmp_path / "checkpoints").exists()


def test_the_top_level_help_lists_every_subcommand_under_the_projects_name(capsys):
    from rlhf_lightning.cli import main

    main(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("rlhf_lightning: RLHF research on PyTorch Lightning")
    assert "usage: python -m rlhf_lightning SUBCOMMAND [options]" in text
    listed = [line.split()[0] for line in text.split("subcommands:\n", 1)[1].split("\n\n")[0].splitlines()]
    assert listed == ["fit", "validate", "test", "predict", "merge", "evaluate", "plot", "serve-reward"]
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    assert capsys.readouterr().out.startswith("usage: python -m rlhf_lightning [options] fit ")
