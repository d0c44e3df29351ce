"""reasoning-gym's tasks as rows and their checker, on the real library: rows are a function of the settings, size
and seed (in this process and in another with another hash seed, as on another rank or after a resume), held-out
rows are not training rows, a mix follows its weights, each fault is one line, and the checker scores with each
task's own ``score_answer`` on the answer between the tags."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections import Counter

import pytest

from rlhf_lightning.tasks import TOKENIZERS, build_task_tokenizer
from rlhf_lightning.tasks.reasoning_gym_checker import ReasoningGymChecker
from rlhf_lightning.tasks.reasoning_gym_rows import GymTask, MissingExtra, generate_rows, task_list
from tests.helpers.environment import with_repo_on_path

ARITHMETIC = {"name": "basic_arithmetic", "config": {"min_terms": 2, "max_terms": 2, "max_digits": 2,
                                                     "operators": ["+", "-"], "allow_parentheses": False}}
MIX = [ARITHMETIC, {"name": "leg_counting", "weight": 3.0, "config": {"min_animals": 1, "max_animals": 2}}]


def fingerprint(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def test_rows_are_a_function_of_the_settings_size_and_seed():
    tasks = task_list(MIX)
    first, again = generate_rows(tasks, 64, seed=3), generate_rows(task_list(MIX), 64, seed=3)
    assert first == again
    assert fingerprint(generate_rows(tasks, 64, seed=4)) != fingerprint(first)
    assert generate_rows(tasks, 32, seed=3) == first[:32]  # a longer run's first rows are a shorter run's rows
    row = first[0]
    assert set(row) == {"task", "question", "answer", "entry"} and row["answer"] == str(row["entry"]["answer"])
    assert row["entry"]["metadata"]["source_dataset"] == row["task"]


def test_held_out_rows_come_from_generators_of_their_own():
    """Seeded 2**31 apart: on a task with a vast space of questions (any 31-bit number) none is a training one."""
    tasks = task_list("count_bits")
    train = generate_rows(tasks, 500, seed=0)
    held_out = generate_rows(tasks, 500, seed=0, held_out=True)
    assert held_out == generate_rows(tasks, 500, seed=0, held_out=True)
    assert not {row["question"] for row in train} & {row["question"] for row in held_out}


def test_a_mix_draws_its_tasks_by_weight():
    counts = Counter(row["task"] for row in generate_rows(task_list(MIX), 800, seed=1))
    assert 0.65 < counts["leg_counting"] / 800 < 0.85  # weight 3 of 4
    assert [task.name for task in task_list("chain_sum")] == ["chain_sum"]
    assert task_list([GymTask("gcd", 2.0)])[0].weight == 2.0


@pytest.mark.slow
def test_rows_are_the_same_in_another_process_with_another_hash_seed():
    """Another rank, or the process that resumes a run, has its own PYTHONHASHSEED: the rows must not depend on it."""
    code = ("import json, hashlib; from rlhf_lightning.tasks.reasoning_gym_rows import generate_rows, task_list; "
            f"rows = generate_rows(task_list({MIX!r}), 64, 7) + generate_rows(task_list({MIX!r}), 16, 7, True); "
            "print(hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], env=with_repo_on_path(PYTHONHASHSEED=seed),
                              capture_output=True, text=True, check=True, timeout=120).stdout.strip()
               for seed in ("1", "2")}
    here = fingerprint(generate_rows(task_list(MIX), 64, 7) + generate_rows(task_list(MIX), 16, 7, True))
    assert digests == {here}


# ---- faults, each one line ------------------------------------------------------------------------------------

def test_an_unknown_task_name_lists_the_close_ones():
    with pytest.raises(ValueError) as error:
        task_list([ARITHMETIC, "leg_countin"])
    assert str(error.value) == ("tasks[1].name: 'leg_countin' is not a reasoning-gym task (close ones: leg_counting, "
                                "letter_counting, rectangle_count)")


@pytest.mark.parametrize("config, expected", [
    ({"max_animals": 0}, "tasks[0].config: task 'leg_counting' rejects the settings {'max_animals': 0}: max_animals must be >= "
                         "min_animals"),
    ({"animals": 3}, "tasks[0].config: task 'leg_counting' has no setting 'animals' (its settings: min_animals, max_animals, "
                     "min_instances, max_instances)"),
])
def test_settings_the_task_rejects_are_one_line(config, expected):
    with pytest.raises(ValueError) as error:
        generate_rows(task_list({"name": "leg_counting", "config": config}), 4, seed=0)
    assert str(error.value) == expected


def test_seed_and_size_belong_to_the_data_module_and_weights_are_positive():
    with pytest.raises(ValueError, match=r"tasks\[0\].config: seed set by the data module"):
        task_list([{"name": "gcd", "config": {"seed": 3}}])
    with pytest.raises(ValueError, match=r"tasks\[1\].weight: expected a positive finite share of the rows, got 0"):
        task_list(["gcd", {"name": "lcm", "weight": 0}])
    with pytest.raises(ValueError, match="'gcd' appears twice"):
        task_list(["gcd", "gcd"])


def test_without_the_package_the_line_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an environment without the extra imports
    with pytest.raises(MissingExtra) as error:
        task_list("leg_counting")
    assert isinstance(error.value, ImportError)
    assert str(error.value).endswith("install the extra: pip install -e '.[reasoning-gym]'")
    assert "\n" not in str(error.value)


# ---- the checker ----------------------------------------------------------------------------------------------

def test_the_checker_scores_the_answer_between_the_tags_with_the_tasks_own_checker():
    rows = generate_rows(task_list(MIX), 8, seed=0)
    entries = [row["entry"] for row in rows]
    right = [f"<think>easy</think> <answer>{row['answer']}</answer>" for row in rows]
    checker = ReasoningGymChecker()
    assert checker(prompts=[""] * 8, completions=right, entry=entries) == [1.0] * 8
    assert checker([""] * 8, [row["answer"] for row in rows], entries) == [0.0] * 8  # no tags: no answer
    assert ReasoningGymChecker(answer_tag=None)([""] * 8, [f" {row['answer']}\n" for row in rows], entries) == [1.0] * 8
    assert checker.answer_of("<answer>1</answer> then <answer> 12 </answer>") == "12"  # the last span, stripped
    assert checker.answer_of("no tags") is None
    assert checker.errors == 0


def test_a_checker_that_raises_scores_zero_and_is_counted_or_stops_the_run():
    """prime_factorization's own checker raises ValueError on an answer that is not numbers (reasoning-gym 0.1.25)."""
    rows = generate_rows(task_list("prime_factorization"), 3, seed=0)
    entries = [row["entry"] for row in rows]
    answers = [f"<answer>{rows[0]['answer']}</answer>", "<answer>abc</answer>", "<answer>x y</answer>"]
    checker = ReasoningGymChecker()
    assert checker([""] * 3, answers, entries) == [1.0, 0.0, 0.0]
    assert checker.take_errors() == 2 and checker.errors == 0
    with pytest.raises(ValueError) as error:
        ReasoningGymChecker(on_checker_error="stop")([""] * 3, answers, entries)
    assert str(error.value) == ("reasoning-gym task 'prime_factorization''s checker raised on row 1, answer 'abc' "
                                "(ValueError: invalid literal for int() with base 10: 'abc'); set on_checker_error: "
                                "zero to score such answers 0 and go on")


def test_the_checker_refuses_bad_settings_and_rows_without_entries():
    with pytest.raises(ValueError, match="on_checker_error: expected 'zero' or 'stop', got 'skip'"):
        ReasoningGymChecker(on_checker_error="skip")
    with pytest.raises(ValueError, match="answer_tag: expected a tag name"):
        ReasoningGymChecker(answer_tag="<answer>")
    with pytest.raises(ValueError, match="the rows have no 'entry' column"):
        ReasoningGymChecker()(["q"], ["<answer>1</answer>"])


def test_the_tokenizer_spells_the_tasks_and_renders_chat():
    assert "reasoning_gym" in TOKENIZERS
    tokenizer = build_task_tokenizer("reasoning_gym")
    question = generate_rows(task_list(MIX), 1, seed=0)[0]["question"]
    ids = tokenizer(question + "<answer>-12</answer>", add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == question + "<answer>-12</answer>"
    assert tokenizer.convert_tokens_to_ids("<answer>") in ids  # one token
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "2 + 2?"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat == "<|im_start|>user\n2 + 2?<|im_end|><|im_start|>assistant\n"
