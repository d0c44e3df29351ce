"""The reasoning-gym reward source: each task's own checker on the rows' entries, the answers a checker raised on
counted per call (or the run stopped), and prompt data without entries refused before any rollout."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.rewards.inputs import RewardInputs
from rlhf_lightning.rewards.reasoning_gym_reward import ReasoningGymReward
from rlhf_lightning.tasks.reasoning_gym_rows import generate_rows, task_list


def _inputs(rows: list[dict], completions: list[str]) -> RewardInputs:
    n = len(completions)
    return RewardInputs(input_ids=torch.zeros(n, 2, dtype=torch.long), attention_mask=torch.ones(n, 2),
                        last_index=torch.ones(n, dtype=torch.long), prompts=[row["question"] for row in rows],
                        completions=completions, completion_ids=[[0]] * n,
                        columns={"task": [row["task"] for row in rows], "entry": [row["entry"] for row in rows],
                                 "answer": [row["answer"] for row in rows]})


def test_scores_with_the_tasks_checkers_and_counts_the_answers_a_checker_raised_on():
    rows = (generate_rows(task_list(["leg_counting", "chain_sum"]), 2, seed=0)
            + generate_rows(task_list("prime_factorization"), 2, seed=0))
    completions = [f"<answer>{rows[0]['answer']}</answer>", "<answer>-1</answer>", "<answer>abc</answer>",
                   f"<answer>{rows[3]['answer']}</answer>"]
    reward = ReasoningGymReward()
    assert reward.name == "reasoning_gym"
    assert reward.score(_inputs(rows, completions)).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert reward.batch_metrics() == {"reasoning_gym/checker_errors": torch.tensor(1.0),
                                      "reasoning_gym/checker_error_rate": torch.tensor(0.25)}
    reward.score(_inputs(rows[:2], completions[:2]))  # the count is the latest call's
    assert reward.batch_metrics()["reasoning_gym/checker_errors"] == 0
    with pytest.raises(ValueError, match=r"task 'prime_factorization''s checker raised on row 2, answer 'abc'"):
        ReasoningGymReward(on_checker_error="stop").score(_inputs(rows, completions))


def test_prompt_data_without_entries_is_refused_before_any_rollout():
    ReasoningGymReward().check_columns(["answer", "entry", "task"])
    with pytest.raises(ValueError) as error:
        ReasoningGymReward().check_columns(["answer"])
    assert str(error.value) == (
        "reward ReasoningGymReward needs the column 'entry' (reasoning-gym's entry of each row), which the prompt "
        "data lacks (its columns: answer); use data: rlhf_lightning.data.reasoning_gym_data.ReasoningGymPromptDataModule")
