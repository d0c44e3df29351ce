"""reasoning-gym's data modules: prompts rendered with the base's chat template (text without one) and the columns
the checker reads, demonstrations of the reference answers, held-out rows of their own, the same rows from every
instance (every rank, a resumed run), and the command line's one-line faults."""

from __future__ import annotations

import pytest

from rlhf_lightning.data.reasoning_gym_data import ReasoningGymPromptDataModule, ReasoningGymSFTDataModule
from rlhf_lightning.tasks import build_task_tokenizer

TASKS = [{"name": "basic_arithmetic", "config": {"min_terms": 2, "max_terms": 2, "max_digits": 2,
                                                  "operators": ["+", "-"], "allow_parentheses": False}},
         {"name": "leg_counting", "weight": 2.0, "config": {"min_animals": 1, "max_animals": 2}}]


def _module(cls, tokenizer=None, **kwargs):
    module = cls(tasks=TASKS, size=kwargs.pop("size", 24), val_size=kwargs.pop("val_size", 8),
                 system_prompt=kwargs.pop("system_prompt", None), batch_size=4, **kwargs)
    module.tokenizer = tokenizer or build_task_tokenizer("reasoning_gym")
    module.setup("fit")
    return module


def test_prompts_are_rendered_with_the_chat_template_and_carry_what_the_checker_reads():
    module = _module(ReasoningGymPromptDataModule)
    assert len(module.train_set) == 24 and len(module.val_set) == 8
    example = module.train_set[0]
    assert example.text.startswith("user\n") and example.text.endswith("assistant\n")  # specials dropped in text
    assert example.raw == [{"role": "user", "content": example.columns["entry"]["question"]}]
    assert set(example.columns) == {"task", "answer", "entry"}
    assert example.columns["task"] in ("basic_arithmetic", "leg_counting")
    assert example.where.startswith("reasoning_gym[train] row 1 (")
    assert module.val_set[0].where.startswith("reasoning_gym[held-out] row 1 (")
    batch = module.collate(module.train_set[:4])
    assert batch["columns"]["entry"][0] == example.columns["entry"]


def test_a_system_prompt_by_name_and_text_prompts_without_a_chat_template():
    module = _module(ReasoningGymPromptDataModule, system_prompt="direct", size=4, val_size=0)
    system = module.train_set[0].raw[0]
    assert system["role"] == "system" and system["content"].startswith("Answer the question directly.")
    plain = build_task_tokenizer("reasoning_gym")
    plain.chat_template = None
    module = _module(ReasoningGymPromptDataModule, plain, system_prompt="Be brief.", size=4, val_size=0)
    assert module.train_set[0].raw == f"Be brief.\n\n{module.train_set[0].columns['entry']['question']}"
    assert module.val_set == []


def test_demonstrations_are_the_reference_answers_between_the_tags():
    module = _module(ReasoningGymSFTDataModule)
    tokenizer = module.tokenizer
    prompts = _module(ReasoningGymPromptDataModule)
    for demonstration, prompt in zip(module.train_set[:6], prompts.train_set[:6], strict=True):
        assert demonstration.input_ids[:demonstration.prompt_length] == prompt.input_ids
        completion = tokenizer.decode(demonstration.input_ids[demonstration.prompt_length:])
        assert completion == f"<answer>{prompt.columns['answer']}</answer><|im_end|>"
    bare = _module(ReasoningGymSFTDataModule, answer_tag=None, size=2, val_size=0)
    assert tokenizer.decode(bare.train_set[0].input_ids[bare.train_set[0].prompt_length:]) == \
        f"{prompts.train_set[0].columns['answer']}<|im_end|>"


def test_every_instance_makes_the_same_rows_and_another_seed_others():
    """What every rank and a resumed run do: build the module anew from the same config."""
    first, again = _module(ReasoningGymPromptDataModule, seed=5), _module(ReasoningGymPromptDataModule, seed=5)
    assert [e.input_ids for e in first.train_set] == [e.input_ids for e in again.train_set]
    assert [e.columns for e in first.val_set] == [e.columns for e in again.val_set]
    other = _module(ReasoningGymPromptDataModule, seed=6)
    assert [e.columns["entry"] for e in other.train_set] != [e.columns["entry"] for e in first.train_set]


def test_arguments_are_checked_when_the_module_is_built():
    with pytest.raises(ValueError, match=r"tasks\[0\].name: 'gcdd' is not a reasoning-gym task \(close ones: gcd"):
        ReasoningGymPromptDataModule(tasks=["gcdd"])
    with pytest.raises(ValueError, match="val_size must be an integer >= 0, got -1"):
        ReasoningGymSFTDataModule(tasks="gcd", val_size=-1)
