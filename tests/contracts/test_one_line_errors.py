"""Every mistake a user makes ends in one line that names what is wrong and what to do, never a traceback from
inside torch or the parser's union report, and never silence: misspelled keys (with the closest names, and TRL's
names mapped to ours), classes that do not import, abbreviated options, reward functions of another signature or
needing a column the data lacks, an empty reward list, prompts and responses longer than the model's positions, a
hub name that is not on disk, a merge whose recorded base is relative, a reward adapter whose base was retrained in
place, a null prompt in preference data, a non-finite loss, and text the tokenizer cannot spell (a warning)."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path

import pytest

from rlhf_lightning.data.modules import PreferenceDataModule
from rlhf_lightning.data.sources import DataFormatError
from tests.helpers.cli import grpo, one_line

REPO = Path(__file__).resolve().parents[2]


def old_style_reward(prompts, responses):
    """The pre-TRL signature."""
    return [1.0 for _ in responses]


def needs_answer(prompts, completions, completion_ids, answer, **columns):
    """Needs a dataset column ``answer``."""
    return [float(a == c) for a, c in zip(answer, completions, strict=True)]


def constant_reward(prompts, completions, completion_ids, **columns):
    """The same score for every response: a group's std is 0."""
    return [1.0 for _ in completions]


@pytest.mark.parametrize("argument, expected", [
    ("--model.init_args.kl_coeff=0.1", "error: model.init_args.kl_coeff: rlhf_lightning.GRPO takes no argument "
     "'kl_coeff' (did you mean kl.coef?); --model.help rlhf_lightning.GRPO lists them all"),
    ("--model.init_args.ent_coeff=0.1", "error: model.init_args.ent_coeff: rlhf_lightning.GRPO takes no argument "
     "'ent_coeff' (did you mean loss.ent_coef?); --model.help rlhf_lightning.GRPO lists them all"),
    ("--model.init_args.kl_coef=0.1", "error: model.init_args.kl_coef: rlhf_lightning.GRPO takes no argument "
     "'kl_coef' (it moved: kl.coef); --model.help rlhf_lightning.GRPO lists them all"),
    ("--model.init_args.policy_lr=1e-3", "error: model.init_args.policy_lr: rlhf_lightning.GRPO takes no argument "
     "'policy_lr' (it moved: optimizer.lr); --model.help rlhf_lightning.GRPO lists them all"),
    ("--model.init_args.max_new_tokens=8", "error: model.init_args.max_new_tokens: rlhf_lightning.GRPO takes no "
     "argument 'max_new_tokens' (it moved: sampling.max_new_tokens); --model.help rlhf_lightning.GRPO lists them all"),
    ("--model.init_args.rollout_correction=token_truncate", "error: model.init_args.rollout_correction: "
     "rlhf_lightning.GRPO takes no argument 'rollout_correction' (it moved: correction.mode); --model.help "
     "rlhf_lightning.GRPO lists them all"),
    ("--model.init_args.clip_against=sampler", "error: model.init_args.clip_against: rlhf_lightning.GRPO takes no "
     "argument 'clip_against' (it moved: policy_loss.clip_against); --model.help rlhf_lightning.GRPO lists them all"),
    ("--model.init_args.beta=0.04", "error: model.init_args.beta: rlhf_lightning.GRPO takes no argument 'beta' "
     "(TRL's beta is kl.coef here); --model.help rlhf_lightning.GRPO lists them all"),
    ("--model.init_args.num_generations=8", "error: model.init_args.num_generations: rlhf_lightning.GRPO takes no "
     "argument 'num_generations' (TRL's num_generations is samples_per_prompt here); --model.help "
     "rlhf_lightning.GRPO lists them all"),
    ("--data.init_args.batchsize=4", "error: data.init_args.batchsize: rlhf_lightning.PromptDataModule takes no "
     "argument 'batchsize' (did you mean batch_size, val_batch_size or ptx_batch_size?); --data.help "
     "rlhf_lightning.PromptDataModule lists them all"),
    ("--model.class_path=my_ppo.LengthPenalizedPPO", "error: model.class_path my_ppo.LengthPenalizedPPO: it cannot "
     "be imported (No module named 'my_ppo'); a class of your own must be importable from where you run: my_ppo.py "
     "in the current folder, or its folder on PYTHONPATH"),
    ("--model.class_path=rlhf_lightning.GRPOO", "error: model.class_path rlhf_lightning.GRPOO: rlhf_lightning has "
     "no 'GRPOO' (did you mean GRPO or RLOO?)"),
    ("--model=rlhf_lightning.GRPOO", "error: model: 'rlhf_lightning.GRPOO': rlhf_lightning has no 'GRPOO' (did you "
     "mean GRPO or RLOO?)"),
    ("--model=my_ppo.LengthPenalizedPPO", "error: model: 'my_ppo.LengthPenalizedPPO' cannot be imported: a class or "
     "function of your own must be importable from where you run (its module in the current folder, or on "
     "PYTHONPATH)"),
    ("--trainer.max_step=5", "error: unrecognized arguments: --trainer.max_step=5 (did you mean "
     "--trainer.max_steps, --trainer.max_time or --trainer.min_steps?)"),
])
def test_a_misspelled_key_or_class_names_the_closest_valid_ones(capsys, argument, expected):
    assert one_line(capsys, "fit", "--config", str(REPO / "configs" / "grpo.yaml"), argument, code=2) == expected


# The flat arguments that became the fields of episodes, asynchronous and loss: old name, a value, the new key.
MOVED_TO_EPISODES_ASYNCHRONOUS_AND_LOSS = [
    ("max_turns", "3", "episodes.max_turns"), ("max_episode_tokens", "40", "episodes.max_tokens"),
    ("max_staleness", "1", "asynchronous.max_staleness"), ("rollout_timeout", "60", "asynchronous.rollout_timeout"),
    ("loss_aggregation", "constant", "loss.aggregation"),
    ("mask_truncated_completions", "true", "loss.mask_truncated_completions"), ("ent_coef", "0.01", "loss.ent_coef"),
    ("ptx_coef", "0.1", "loss.ptx_coef"),
]


@pytest.mark.parametrize("old, value, new", MOVED_TO_EPISODES_ASYNCHRONOUS_AND_LOSS,
                         ids=[old for old, _, _ in MOVED_TO_EPISODES_ASYNCHRONOUS_AND_LOSS])
def test_an_old_flat_name_of_episodes_asynchronous_or_loss_names_its_new_key(capsys, old, value, new):
    line = one_line(capsys, "fit", "--config", str(REPO / "configs" / "grpo.yaml"), f"--model.init_args.{old}={value}",
                    code=2)
    assert line == (f"error: model.init_args.{old}: rlhf_lightning.GRPO takes no argument '{old}' (it moved: {new}); "
                    "--model.help rlhf_lightning.GRPO lists them all")


def test_the_old_environment_argument_names_its_new_key(capsys):
    """``environment`` was given as a class (``class_path`` + ``init_args``): its line names the new key too."""
    line = one_line(capsys, "fit", "--config", str(REPO / "configs" / "grpo.yaml"),
                    "--model.init_args.environment={class_path: tests.helpers.episodes.Feedback}", code=2)
    assert line == ("error: model.init_args.environment: rlhf_lightning.GRPO takes no argument 'environment' (it "
                    "moved: episodes.environment); --model.help rlhf_lightning.GRPO lists them all")


@pytest.mark.parametrize("argument, expected", [
    ("--model.init_args.update.micro_batch_tokens=512.5",
     "error: model.init_args.update.micro_batch_tokens: expected an integer or null, got 512.5"),
    ("--model.init_args.update.target_kl=abc",
     "error: model.init_args.update.target_kl: expected a number or null, got abc"),
])
def test_a_value_an_optional_argument_cannot_take_says_what_it_takes(capsys, argument, expected):
    assert one_line(capsys, *grpo("unused", "unused", argument), code=2) == expected


@pytest.mark.parametrize("overrides, expected", [
    (["--model.init_args.update.micro_batch_tokens=0"],
     "error: update.micro_batch_tokens must be an integer >= 1 or null, got 0"),
    (["--model.init_args.update.micro_batch_tokens=512", "--model.init_args.update.gradient_accumulation=2"],
     "error: update.micro_batch_tokens=512 and update.gradient_accumulation=2 both split each minibatch into "
     "micro-batches: by tokens, or into equal parts; set update.gradient_accumulation: 1 or "
     "update.micro_batch_tokens: null"),
])
def test_a_token_budget_of_zero_or_beside_gradient_accumulation_is_refused(capsys, tiny_model_dir, reward_dir,
                                                                           overrides, expected):
    assert one_line(capsys, *grpo(tiny_model_dir, reward_dir, *overrides)) == expected


@pytest.mark.parametrize("overrides, expected", [
    (["--model.init_args.episodes.max_turns=0"], "error: episodes.max_turns must be an integer >= 1, got 0"),
    (["--model.init_args.episodes.max_turns=3"], "error: episodes.max_turns=3, episodes.max_tokens=None: they bound "
     "episodes, and there is no episodes.environment; set it, or leave them at 4 and null"),
    (["--model.init_args.asynchronous.max_staleness=-1"],
     "error: asynchronous.max_staleness must be an integer >= 0, got -1"),
    (["--model.init_args.asynchronous.rollout_timeout=0"], "error: asynchronous.rollout_timeout must be > 0, got 0.0"),
    (["--model.init_args.loss.ent_coef=-0.1"], "error: loss.ent_coef must be >= 0, got -0.1"),
    (["--model.init_args.loss.mask_truncated_completions=true", "--model.init_args.sampling.stop_token=null"],
     "error: loss.mask_truncated_completions needs a sampling.stop_token: without one no response ever stops, so "
     "every response would be masked and nothing would train"),
], ids=["episodes.max_turns", "episodes-without-environment", "asynchronous.max_staleness",
        "asynchronous.rollout_timeout", "loss.ent_coef", "loss.mask_truncated_completions"])
def test_a_bad_field_of_episodes_asynchronous_or_loss_is_one_line_naming_its_dotted_key(capsys, overrides, expected):
    """Refused by the constructor, before the model loads (the base named here does not exist)."""
    assert one_line(capsys, *grpo("/nonexistent/model", "/nonexistent/reward", *overrides)) == expected


def test_a_misspelled_key_in_a_config_file_is_named_at_its_line_too(capsys, tmp_path):
    config = tmp_path / "my.yaml"
    config.write_text("model:\n  class_path: rlhf_lightning.DPO\n  init_args:\n    base: {name_or_path: m}\n"
                      "    betta: 0.2\n")
    assert one_line(capsys, "fit", "--config", str(config), code=2) == (
        f"error: {config}:5: model.init_args.betta: rlhf_lightning.DPO takes no argument 'betta' (did you mean beta?); "
        "--model.help rlhf_lightning.DPO lists them all")


@pytest.mark.parametrize("reward, expected", [
    ("tests.contracts.test_one_line_errors.old_style_reward", "error: reward function tests.contracts.test_one_line_errors."
     "old_style_reward(prompts, responses) cannot take TRL's keywords: it is called as fn(prompts=..., "
     "completions=..., completion_ids=..., **columns) and should accept **kwargs for the dataset's columns (missing "
     "a required argument: 'responses')"),
    ("tests.contracts.test_one_line_errors.needs_answer", "error: reward function tests.contracts.test_one_line_errors.needs_answer "
     "needs column 'answer', which the prompt data lacks (its columns: only prompt)"),
])
def test_a_reward_function_that_cannot_be_called_is_refused_before_the_first_rollout(
        capsys, tiny_model_dir, reward_dir, reward, expected):
    source = json.dumps({"class_path": "rlhf_lightning.FunctionReward", "init_args": {"fn": reward}})
    assert one_line(capsys, *grpo(tiny_model_dir, reward_dir, f"--model.init_args.reward={source}")) == expected


def test_an_empty_reward_list_is_refused(capsys, tiny_model_dir, reward_dir):
    assert one_line(capsys, *grpo(tiny_model_dir, reward_dir, "--model.init_args.reward=[]")) == (
        "error: reward: no reward source given (an empty list); give at least one, e.g. {class_path: "
        "rlhf_lightning.AdapterReward, init_args: {path: ...}}")


def test_prompt_and_response_beyond_the_models_positions_are_refused_at_setup(capsys, tiny_model_dir, reward_dir):
    assert one_line(capsys, *grpo(tiny_model_dir, reward_dir, "--model.init_args.sampling.max_new_tokens=70")) == (
        f"error: the longest prompt (4 tokens) and sampling.max_new_tokens=70 reach 74 positions, beyond the 64 of "
        f"model {tiny_model_dir} (n_positions), whose learned position embeddings stop there; lower "
        "sampling.max_new_tokens or data.init_args.max_length (longer prompts are then skipped)")


def test_a_non_finite_loss_at_the_first_step_is_one_line(capsys, tiny_model_dir, reward_dir):
    source = json.dumps({"class_path": "rlhf_lightning.FunctionReward",
                         "init_args": {"fn": "tests.contracts.test_one_line_errors.constant_reward"}})
    line = one_line(capsys, *grpo(tiny_model_dir, reward_dir, f"--model.init_args.reward={source}",
                                  "--model.init_args.advantages.std_eps=0", "--model.init_args.advantages.scale_rewards=group"))
    assert line.startswith("error: iteration 1, optimizer step 1 of 4, micro-batch 1 of 1: non-finite loss "), line
    assert line.endswith("; set optimizer.nonfinite: skip to skip such optimizer steps instead")


def test_a_reward_adapter_whose_base_was_retrained_in_place_is_one_line(capsys, tiny_model_dir, reward_dir, tmp_path):
    from rlhf_lightning.models.fingerprint import BASE_RECORD, weights_fingerprint
    from tests.helpers.models import retrain_in_place

    base = tmp_path / "sft"  # where the reward adapter's base was, retrained since
    shutil.copytree(tiny_model_dir, base)
    retrain_in_place(base)
    before, after = weights_fingerprint(str(tiny_model_dir)), weights_fingerprint(str(base))
    assert one_line(capsys, *grpo(base, reward_dir)) == (
        f"error: the reward adapter {reward_dir} was trained on other weights than base {base} holds now (its "
        f"{BASE_RECORD} says {before[:12]}, the base's files give {after[:12]}): the base was retrained or replaced "
        "since; train the reward adapter again on this base, or load the base it was trained on (if only the base's "
        f"file format changed, delete {BASE_RECORD} there to compare paths only)")


def test_a_hub_name_that_is_not_on_disk_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub is not tried: transformers' own refusal, named
    line = one_line(capsys, "fit", "--config", str(REPO / "configs" / "dpo.yaml"),
                    "--model.init_args.base.name_or_path=no-such-org/no-such-model", "--trainer.logger=false")
    assert line.startswith("error: model 'no-such-org/no-such-model' is not a local folder and could not be fetched "
                           "from the Hugging Face hub (")
    assert line.endswith("): check the name, or give the folder it is saved in")


def test_a_hub_name_without_the_hub_is_one_line_at_once_and_leaves_no_run_folder(capsys, monkeypatch):
    """No network (this machine, CI): one line before any of huggingface_hub's retries (about a minute of them
    otherwise), saying what to do, and no empty run folder left behind."""
    from rlhf_lightning.models import loading

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(loading, "hub_unreachable", lambda: "huggingface.co: Network is unreachable")
    line = one_line(capsys, "fit", "--config", str(REPO / "configs" / "sft.yaml"),
                    "--model.init_args.base.name_or_path=gpt2", "--trainer.default_root_dir=outputs/sft-hub")
    assert line == ("error: model 'gpt2' is not a local folder, not in the Hugging Face cache, and the hub cannot be "
                    "reached from this machine (huggingface.co: Network is unreachable): give the folder it is saved "
                    "in, or download it where the hub is reachable (huggingface-cli download) and set "
                    "HF_HUB_OFFLINE=1 here")
    assert not Path("outputs/sft-hub").exists()


def test_merge_of_an_adapter_whose_recorded_base_is_relative_names_base(capsys, tmp_path, reward_dir):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = json.loads((reward_dir / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "outputs/sft/model"}))
    assert one_line(capsys, "merge", "--adapter", str(adapter), "--out", str(tmp_path / "merged")) == (
        f"error: the adapter {adapter} records its base as outputs/sft/model (relative to the folder it was trained "
        "from, not a folder from here): give the base with --base PATH (the model the adapter was trained on, e.g. "
        "the SFT stage's export)")


def test_a_null_prompt_in_preference_data_names_the_row(tmp_path, tiny_model_dir):
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "the cat", "chosen": " sat", "rejected": " ran"} for _ in range(12)]
    rows[10]["prompt"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    from rlhf_lightning.models.loading import load_tokenizer
    from rlhf_lightning.models.spec import BaseModelSpec

    data = PreferenceDataModule(dataset=str(tmp_path / "pairs.parquet"), val_fraction=0.0, batch_size=2)
    data.tokenizer = load_tokenizer(BaseModelSpec(name_or_path=str(tiny_model_dir)))
    with pytest.raises(DataFormatError, match=r"pairs.parquet row 11: column 'prompt' is null; give the row "
                                              r"a prompt \(text or messages\), or drop the column"):
        data.setup("fit")


def test_text_the_tokenizer_cannot_spell_is_warned_about(tmp_path, caplog):
    from rlhf_lightning.models.loading import load_tokenizer
    from rlhf_lightning.models.spec import BaseModelSpec

    rows = [{"prompt": "Please summarise this quarterly earnings report for the board", "chosen": " Revenue grew.",
             "rejected": " No."} for _ in range(8)]
    (tmp_path / "english.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    data = PreferenceDataModule(dataset=str(tmp_path / "english.jsonl"), val_fraction=0.0, batch_size=2)
    data.tokenizer = load_tokenizer(BaseModelSpec(tokenizer="synthetic"))
    with caplog.at_level(logging.WARNING):
        data.setup("fit")
    warnings = [r.getMessage() for r in caplog.records if "does not spell this text" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"{tmp_path / 'english.jsonl'}: ")
    share = float(warnings[0].split(": ")[1].split("%")[0])
    assert 50 < share <= 100 and not math.isnan(share)


def test_no_warning_for_the_embedded_task(caplog):
    from rlhf_lightning.models.loading import load_tokenizer
    from rlhf_lightning.models.spec import BaseModelSpec

    data = PreferenceDataModule(synthetic_rows=40, val_fraction=0.0, batch_size=2)
    data.tokenizer = load_tokenizer(BaseModelSpec(tokenizer="synthetic"))
    with caplog.at_level(logging.WARNING):
        data.setup("fit")
    assert not [r for r in caplog.records if "does not spell" in r.getMessage()]
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # tests never reach the hub


def test_an_argument_that_moved_into_a_group_is_refused_at_its_line_of_the_config_file_naming_its_new_key(capsys, tmp_path):
    old = tmp_path / "old.yaml"  # written before sampling, kl and optimizer were groups
    old.write_text("model:\n  init_args:\n    samples_per_prompt: 4\n    kl_coef: 0.1\n")
    line = one_line(capsys, "fit", "--config", str(REPO / "configs" / "grpo.yaml"), "--config", str(old), code=2)
    assert line.startswith(f"error: {old}:4: model.init_args.kl_coef: rlhf_lightning.GRPO takes no argument "
                           "'kl_coef' (it moved: kl.coef)"), line


@pytest.mark.parametrize("old, text, line_number, new", [
    ("max_turns", "max_turns: 3", 4, "episodes.max_turns"),
    ("max_staleness", "max_staleness: 1", 4, "asynchronous.max_staleness"),
    ("loss_aggregation", "loss_aggregation: constant", 4, "loss.aggregation"),
    ("ent_coef", "ent_coef: 0.01", 4, "loss.ent_coef"),
], ids=["max_turns", "max_staleness", "loss_aggregation", "ent_coef"])
def test_an_old_name_of_episodes_asynchronous_or_loss_in_a_config_file_is_refused_at_its_line(capsys, tmp_path, old,
                                                                                              text, line_number, new):
    old_config = tmp_path / "old.yaml"  # written before episodes, asynchronous and loss were groups
    old_config.write_text(f"model:\n  init_args:\n    samples_per_prompt: 4\n    {text}\n")
    line = one_line(capsys, "fit", "--config", str(REPO / "configs" / "grpo.yaml"), "--config", str(old_config), code=2)
    assert line == (f"error: {old_config}:{line_number}: model.init_args.{old}: rlhf_lightning.GRPO takes no argument "
                    f"'{old}' (it moved: {new}); --model.help rlhf_lightning.GRPO lists them all")


def test_an_old_environment_in_a_config_file_is_refused_naming_its_new_key(capsys, tmp_path):
    old_config = tmp_path / "old.yaml"  # the episodes' environment as configs gave it before the episodes group
    old_config.write_text("model:\n  init_args:\n    environment:\n      class_path: tests.helpers.episodes.Feedback\n"
                          "    max_turns: 3\n")
    line = one_line(capsys, "fit", "--config", str(REPO / "configs" / "grpo.yaml"), "--config", str(old_config), code=2)
    assert line == (f"error: {old_config}:3: model.init_args.environment: rlhf_lightning.GRPO takes no argument "
                    "'environment' (it moved: episodes.environment); --model.help rlhf_lightning.GRPO lists them all")
