"""The embedded verifiable-reward task: worked additions, slips in the demonstrations, the exact checker, and a GRPO
run on it through the CLI with the checker as its reward."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from rlhf_lightning.cli import main
from rlhf_lightning.data.modules import PromptDataModule, SFTDataModule
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.tasks.arithmetic import (
    ArithmeticTask,
    build_tokenizer,
    exact_match,
    final_answer,
    parse_prompt,
    prompt_text,
    worked_answer,
)

REPO = Path(__file__).resolve().parents[2]


def test_worked_answers_are_right_with_carries_and_unequal_lengths():
    assert worked_answer(47, 38) == ("7 + 8 = 1 5 , 4 + 3 + 1 = 8 , answer 8 5", 85)
    assert worked_answer(999, 1)[1] == 1000 and worked_answer(0, 0) == ("0 + 0 = 0 , answer 0", 0)
    rng = random.Random(0)
    for _ in range(2000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        text, answer = worked_answer(a, b)
        assert answer == a + b and final_answer(text) == a + b
        assert parse_prompt(prompt_text(a, b)) == (a, b)


def test_a_slip_carries_through_to_the_answer():
    text, answer = worked_answer(47, 38, slip=(0, 1))  # 7 + 8 written as 16
    assert text == "7 + 8 = 1 6 , 4 + 3 + 1 = 8 , answer 8 6" and answer == 86
    text, answer = worked_answer(47, 38, slip=(0, -2))  # 13: still a carry
    assert answer == 83


def test_demonstrations_have_the_stated_error_rate_and_fit_the_tokenizer():
    rows = ArithmeticTask(seed=1, error_rate=0.3).sft_rows(4000)
    correct = exact_match([row["prompt"] for row in rows], [row["completion"] for row in rows])
    # A slip of +-1/2 is sometimes clipped back to the true sum: slightly fewer than 30 % are wrong.
    assert 0.25 < 1 - sum(correct) / len(correct) < 0.31
    tokenizer = build_tokenizer()
    for row in rows[:500]:
        ids = tokenizer(row["prompt"] + row["completion"])["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == (row["prompt"] + row["completion"])
    assert ArithmeticTask(seed=1).sft_rows(50) == rows[:50]  # deterministic from the seed
    assert ArithmeticTask(seed=2).sft_rows(50) != rows[:50]


def test_the_checker_reads_the_answer_column_or_the_prompt():
    prompts = [prompt_text(47, 38)] * 4
    completions = ["... answer 8 5", "answer 8 6", "7 + 8 = 1 5", "answer 8 5 , answer 8 4"]
    assert exact_match(prompts, completions) == [1.0, 0.0, 0.0, 0.0]  # the last answer counts
    assert exact_match(prompts, completions, answer=[86, 86, 86, 84]) == [0.0, 1.0, 0.0, 1.0]
    assert exact_match(["add 4 7 + 3 8"], ["answer 8 5"], answer=[None]) == [1.0]
    with pytest.raises(ValueError, match=r"exact_match: row 0: prompt 'hello' is not 'add A \+ B'"):
        exact_match(["hello"], ["answer 1"])


def test_preference_pairs_prefer_the_right_answer():
    for row in ArithmeticTask(seed=0).preference_rows(200):
        a, b = parse_prompt(row["prompt"])
        assert final_answer(row["chosen"]) == a + b != final_answer(row["rejected"])


def test_data_modules_generate_the_task_and_pass_the_answer_column():
    tokenizer = load_tokenizer(BaseModelSpec(tokenizer="arithmetic"))
    prompts = PromptDataModule(dataset="arithmetic", synthetic_rows=40, batch_size=8, val_fraction=0.25)
    prompts.tokenizer = tokenizer
    prompts.setup("fit")
    batch = next(iter(prompts.train_dataloader()["prompts"]))
    assert [sum(parse_prompt(p)) for p in batch["prompt"]] == batch["columns"]["answer"]
    sft = SFTDataModule(dataset="arithmetic", synthetic_rows=40, batch_size=8)
    sft.tokenizer = tokenizer
    sft.setup("fit")
    assert next(iter(sft.train_dataloader()))["input_ids"].shape[0] == 8


@pytest.mark.slow
def test_grpo_on_the_checker_through_the_cli(tmp_path):
    """``configs/arithmetic_grpo.yaml`` on a tiny fresh model: the checker's score and the held-out accuracy are
    logged (to a CSV logger here) and the adapter is exported."""
    import csv

    spec = BaseModelSpec(architecture={"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2,
                                       "n_positions": 96}, tokenizer="arithmetic")
    tokenizer = load_tokenizer(spec)
    torch.manual_seed(0)
    load_causal_lm(spec, tokenizer).save_pretrained(tmp_path / "sft")
    tokenizer.save_pretrained(tmp_path / "sft")
    main(["fit", "--config", str(REPO / "configs/arithmetic_grpo.yaml"),
          f"--model.init_args.base.name_or_path={tmp_path / 'sft'}", "--model.init_args.sampling.max_new_tokens=6",
          "--model.init_args.samples_per_prompt=2", "--data.init_args.synthetic_rows=20",
          "--data.init_args.batch_size=4", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
          "--trainer.val_check_interval=2", "--trainer.num_sanity_val_steps=0", "--trainer.callbacks=[]",
          "--trainer.enable_progress_bar=false", "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
          f"--trainer.logger.init_args.save_dir={tmp_path}", f"--model.init_args.export_dir={tmp_path / 'out'}"])
    with open(next(tmp_path.rglob("metrics.csv"))) as file:
        rows = list(csv.DictReader(file))
    keys = {key for row in rows for key, value in row.items() if value}
    assert {"grpo/objective/score", "grpo/val/score", "grpo/val/gold"} <= keys
    accuracy = [float(row["grpo/val/gold"]) for row in rows if row.get("grpo/val/gold")]
    assert all(0.0 <= value <= 1.0 for value in accuracy)
    # the config's pass_at_k (8 more responses per held-out problem): pass@k grows with k, maj@k is a share
    names = ["pass@1", "pass@4", "pass@8", "maj@4", "maj@8"]
    assert {f"grpo/val/{name}" for name in names} <= keys and "grpo/val/maj@1" not in keys
    for row in (row for row in rows if row.get("grpo/val/pass@1")):
        value = {name: float(row[f"grpo/val/{name}"]) for name in names}
        assert value["pass@1"] <= value["pass@4"] <= value["pass@8"] <= 1.0
        assert 0.0 <= value["maj@4"] <= 1.0 and 0.0 <= value["maj@8"] <= 1.0
    assert (tmp_path / "out/policy/adapter_model.safetensors").exists()
