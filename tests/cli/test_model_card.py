"""Model cards: an export's card says when, with which version, how long and with which hyper-parameters it was
trained, and compares a reward model with its untrained head (it has no starting policy); ``merge`` writes a card
of what it merged, and its files are readable as the umask allows."""

from __future__ import annotations

import datetime
import re
import stat

import lightning as L
import pytest
import torch
import yaml

from rlhf_lightning import GRPO, SFT, PreferenceDataModule, RewardModel
from rlhf_lightning.callbacks import RunReport, ValidateAtStart
from rlhf_lightning.cli.model_card import (
    change_label,
    hyperparameters_block,
    merge_card,
    package_version,
    write_model_card,
)
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from rlhf_lightning.stages.process_reward_model import ProcessRewardModel

TODAY = datetime.date.today().isoformat()


def test_the_package_version_and_the_comparison_fit_the_stage():
    assert package_version() == "0.1.0"  # pyproject.toml's, as installed
    make = object.__new__  # the label reads the class only: nothing is built
    assert [change_label(make(cls)) for cls in (GRPO, SFT, RewardModel, ProcessRewardModel)] == [
        "Change from the starting policy",
        "Change from the base model (its validation before the first step)",
        "Change from the untrained head (its validation before the first step)",
        "Change from the untrained head (its validation before the first step)"]


def test_hyperparameters_read_as_a_compact_yaml_block():
    block = hyperparameters_block({"optimizer": {"lr": 1e-4}, "lora": LoraSpec(r=2, alpha=4),
                                   "base": {"name_or_path": "m"}, "reward": constant, "stop": ["a", "b"]})
    assert yaml.safe_load(block)["lora"]["r"] == 2
    assert block.splitlines()[2:] == ["optimizer: {lr: 0.0001}", "reward: builtins.function",
                                      "stop: [a, b]"]  # sorted keys
    assert block.splitlines()[0] == "base: {name_or_path: m}"  # a short mapping or list on one line
    # an object is named by its class (reward: above), never by a repr with a memory address


def constant(prompts, completions, **columns):
    return [1.0] * len(completions)


def test_a_reward_models_card(tiny_model_dir, tmp_path):
    """A 2-step reward model fit: its card has the date, the version, the wall time, the held-out accuracy and
    its change from the untrained head, and the hyper-parameters as the config gave them."""
    torch.manual_seed(0)
    module = RewardModel(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), lora=LoraSpec(r=2, alpha=4),
                         export_dir="adapters")
    data = PreferenceDataModule(dataset="synthetic", synthetic_rows=40, batch_size=8, val_fraction=0.2)
    report = RunReport(print_at_fit_end=False)
    trainer = L.Trainer(max_steps=2, val_check_interval=2, limit_val_batches=1, check_val_every_n_epoch=None,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[ValidateAtStart(), report])
    trainer.fit(module, datamodule=data)
    settings = {"base": {"name_or_path": str(tiny_model_dir)}, "lora": {"r": 2, "alpha": 4},
                "optimizer": {"lr": 1e-4}}
    card = write_model_card(trainer, module, ["fit", "--config", "reward.yaml"], report.change_text(),
                            {"synthetic_rows": 40}, settings).read_text()
    assert "- **Stage**: `rlhf_lightning.RewardModel`, 2 batches, 2 optimizer steps\n" in card
    assert re.search(r"\n- \*\*Wall time\*\*: \d+s\n", card)
    threads = torch.get_num_threads()
    assert (f"\n- **Hardware**: cpu, 1 device x 1 node, {threads} CPU thread{'s' if threads != 1 else ''} per "
            "process\n") in card
    torch.set_num_threads(1)  # the card says the run's own count
    try:
        assert "1 CPU thread per process" in write_model_card(trainer, module, ["fit"]).read_text()
    finally:
        torch.set_num_threads(threads)
    assert f"\n- **Made**: {TODAY} with rlhf_lightning 0.1.0\n" in card
    assert re.search(r"\n- \*\*Held-out accuracy\*\*: rm/val/accuracy [\d.]+ · rm/val/gold_accuracy [\d.]+ \(share "
                     r"of held-out pairs it orders as labelled; gold_accuracy: as the noise-free gold reward orders "
                     r"them\)\n", card)
    assert "starting policy" not in card
    assert re.search(r"\n- \*\*Change from the untrained head \(its validation before the first step\)\*\*: "
                     r"rm/val/accuracy [\d.]+ → [\d.]+ · ", card)
    hyperparameters = card.split("## Hyper-parameters\n", 1)[1]
    assert "(as the config resolved them: `model.init_args` of the run folder's `config.yaml`)" in hyperparameters
    assert yaml.safe_load(hyperparameters.split("```yaml\n", 1)[1].split("```", 1)[0]) == settings
    # Without the config's settings, the module's saved hyper-parameters.
    saved = write_model_card(trainer, module, ["fit"]).read_text().split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(saved)["lora"]["r"] == 2 and yaml.safe_load(saved)["export_dir"] == "adapters"
    assert not [key for key in yaml.safe_load(saved) if key.startswith("_")]


def test_a_merged_models_card_names_what_was_merged_and_how_the_adapter_was_trained(tmp_path):
    adapter = tmp_path / "outputs/ppo/adapters/policy"
    adapter.mkdir(parents=True)
    (adapter.parent / "README.md").write_text("---\ntags:\n- ppo\n---\n\n# ppo: trained with rlhf_lightning\n\n"
                                              "- **Stage**: `rlhf_lightning.PPO`, 96 iterations, 768 optimizer steps\n"
                                              "- **Made**: 2026-11-25 with rlhf_lightning 0.1.0\n")
    card = merge_card(adapter, "outputs/sft/model", ["merge", "--adapter", str(adapter), "--out", "merged"])
    assert card.startswith("---\nbase_model: outputs/sft/model\nlibrary_name: transformers\n")
    assert (f"- **Merged**: the LoRA adapter `{adapter}` folded into its base `outputs/sft/model` (a standalone "
            "transformers model: `AutoModelForCausalLM.from_pretrained` reads it without peft)\n") in card
    assert f"- **Command**: `python -m rlhf_lightning merge --adapter {adapter} --out merged`\n" in card
    assert f"- **Made**: {TODAY} with rlhf_lightning 0.1.0\n" in card
    assert card.endswith(f"## How the adapter was trained (from `{adapter.parent / 'README.md'}`)\n\n"
                         "- **Stage**: `rlhf_lightning.PPO`, 96 iterations, 768 optimizer steps\n"
                         "- **Made**: 2026-11-25 with rlhf_lightning 0.1.0\n")


@pytest.mark.slow
def test_merge_writes_its_card_and_files_others_can_read(tiny_model_dir, reward_dir, tmp_path):
    import os

    from rlhf_lightning.cli.merge_command import merge_adapter

    mask = os.umask(0o022)
    try:
        merged = merge_adapter(reward_dir, tmp_path / "merged", str(tiny_model_dir))
    finally:
        os.umask(mask)
    card = (merged / "README.md").read_text()
    assert f"`{reward_dir}` folded into its base `{tiny_model_dir}`" in card
    assert (f"- **Command**: `python -m rlhf_lightning merge --adapter {reward_dir} --out "
            f"{tmp_path / 'merged'}`") in card  # the recorded base: no --base
    assert "More Information Needed" not in card and "How the adapter was trained" not in card  # peft's template
    weights = merged / "model.safetensors"
    assert weights.exists()
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in merged.iterdir()}
    assert set(modes.values()) == {0o644}, modes  # safetensors alone would leave the weights 0o600
