"""Held-out samples' gold reward: a gold reward with ``**kwargs`` receives the rows' columns (repeated with the
samples of each prompt), one without them does not, and the per-task means add up per group."""

from __future__ import annotations

import torch

from rlhf_lightning.core.held_out import gold_scores, takes_columns
from rlhf_lightning.tasks.arithmetic import exact_match
from rlhf_lightning.tasks.reasoning_gym_checker import ReasoningGymChecker
from rlhf_lightning.tasks.reasoning_gym_rows import generate_rows, task_list
from rlhf_lightning.utils.metrics import GroupMeans


def two_arguments(prompts, completions):
    return [float(len(c)) for c in completions]


def test_a_gold_reward_with_kwargs_gets_the_columns_repeated_per_sample():
    rows = generate_rows(task_list("chain_sum"), 2, seed=0)
    columns = {"entry": [row["entry"] for row in rows], "task": [row["task"] for row in rows]}
    completions = [f"<answer>{rows[0]['answer']}</answer>", "<answer>x</answer>",
                   "no answer", f"<answer>{rows[1]['answer']}</answer>"]
    assert takes_columns(ReasoningGymChecker()) and not takes_columns(two_arguments)
    assert gold_scores(ReasoningGymChecker(), ["q0", "q1"], completions, columns, repeat=2) == [1.0, 0.0, 0.0, 1.0]
    assert gold_scores(two_arguments, ["q0", "q1"], ["ab", "c"], columns) == [2.0, 1.0]  # columns not passed
    # the arithmetic checker reads its answer column when given one, the prompt otherwise: the same scores
    assert gold_scores(exact_match, ["add 1 + 2"], [" answer 3"], {"answer": [3]}) == [1.0]
    assert gold_scores(exact_match, ["add 1 + 2"], [" answer 3"]) == [1.0]


def test_group_means_add_up_per_group():
    means = GroupMeans(3)
    means.update(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 2]))
    means.update(torch.tensor([0.5]), torch.tensor([2]))
    values, counts = means.compute()
    assert values.tolist() == [0.5, 0.0, 0.75] and counts.tolist() == [2.0, 0.0, 2.0]


def response_length(prompts, completions):
    """A gold that differs between responses: their length in characters."""
    return [float(len(completion)) for completion in completions]


def test_validation_logs_the_golds_spread_over_the_held_out_responses(tiny_model_dir, reward_dir, tmp_path):
    """``<prefix>/val/gold_std``: the scale the summary measures the gold's change in; 0 for a gold that never
    varies, above 0 for one that does."""
    import lightning as L

    from rlhf_lightning import GRPO
    from tests.helpers.online import make_online, prompts

    logged = {}
    for name, gold in (("constant", lambda prompts, completions: [1.0] * len(completions)),
                       ("length", response_length)):
        module = make_online(GRPO, tiny_model_dir, reward_dir, gold_reward=gold)
        trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path, limit_val_batches=1)
        trainer.validate(module, datamodule=prompts(module, n=16, batch_size=4, val_fraction=0.5))
        logged[name] = {key: float(value) for key, value in trainer.callback_metrics.items()}
    assert logged["constant"]["grpo/val/gold"] == 1.0 and logged["constant"]["grpo/val/gold_std"] == 0.0
    assert logged["length"]["grpo/val/gold_std"] > 0
    # The samples behind the mean (with the SD, its error bar): one held-out batch of 4 prompts.
    assert logged["constant"]["grpo/val/gold_count"] == logged["length"]["grpo/val/gold_count"] == 4
