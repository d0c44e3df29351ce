"""A rollout's experience (``rlhf_lightning.core.experience``) and the rewards shaped from it, by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_lightning.algorithms import token_rewards
from rlhf_lightning.algorithms.shaped_rewards import ShapedRewards
from rlhf_lightning.core.experience import Experience, sequence_kl
from rlhf_lightning.stages.ppo import CriticExperience


def test_token_rewards_put_the_score_on_the_last_response_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    rewards = token_rewards(torch.tensor([1.0, -2.0]), kl, mask, kl_coef=0.5)
    expected = torch.tensor([[-0.05, -0.1, -0.15 + 1.0], [-0.25 - 2.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)


def test_experience_select_takes_rows_of_every_field_keeps_its_class_and_is_immutable():
    experience = Experience(
        input_ids=torch.arange(12).view(3, 4), attention_mask=torch.ones(3, 4),
        response_mask=torch.tensor([[True, True], [True, False], [True, True]]),
        scores=torch.tensor([1.0, 2.0, 3.0]), is_stopped=torch.tensor([True, False, True]),
        sampler_logprobs=torch.zeros(3, 2), logprobs=torch.zeros(3, 2), ref_logprobs=torch.zeros(3, 2), group_size=3,
    )
    with_values = experience.extended(CriticExperience, values=torch.arange(6.0).view(3, 2))
    part = with_values.select(torch.tensor([2, 0]))
    assert type(part) is CriticExperience  # an algorithm's fields travel with their rows
    assert part.scores.tolist() == [3.0, 1.0] and part.values.tolist() == [[4.0, 5.0], [0.0, 1.0]]
    assert part.is_stopped.tolist() == [True, True] and part.returns is None
    assert part.advantages is None and part.prompt_length == 2 and part.group_size == 3
    assert part.responses.tolist() == [[10, 11], [2, 3]]
    with_advantages = dataclasses.replace(experience, advantages=torch.ones(3, 2))
    assert experience.advantages is None and with_advantages.advantages.sum() == 6  # a new object
    with pytest.raises(dataclasses.FrozenInstanceError):
        experience.scores = torch.zeros(3)


def test_shaped_rewards_place_the_kl_the_score_and_dense_rewards():
    mask = torch.tensor([[True, True, True], [True, True, False]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.0]])
    turns = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # an environment's reward at the end of a turn
    rewards = ShapedRewards(torch.tensor([2.0, -1.0]), mask, kl, kl_coef=0.5, dense=turns)
    # per sequence: score + dense - coef * sum KL (GRPO, RLOO)
    torch.testing.assert_close(rewards.sequence_rewards(), torch.tensor([2.0 + 1.0 - 0.3, -1.0 - 0.5]))
    # per token: -coef KL everywhere, the score at the last token, dense where it is (PPO, REINFORCE++)
    expected = torch.tensor([[-0.05, -0.1 + 1.0, -0.15 + 2.0], [-0.25, -0.25 - 1.0, 0.0]])
    torch.testing.assert_close(rewards.token_rewards(), expected)
    # the sum over tokens is the sequence reward: no reward lost or counted twice
    torch.testing.assert_close(rewards.token_rewards().sum(-1), rewards.sequence_rewards())
    cost = rewards.with_dense(-0.1 * mask.float())  # a subclass's cost per token adds to the turns' rewards
    torch.testing.assert_close(cost.token_rewards(), expected - 0.1 * mask.float())
    assert torch.equal(ShapedRewards(torch.tensor([2.0, -1.0]), mask).sequence_rewards(), torch.tensor([2.0, -1.0]))


def test_sequence_kl_sums_the_log_ratio_over_response_tokens_only():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -3.0], [-1.0, -0.25, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # row 0: 0.5 - 1.0 + 0 ; row 1: 0.5 - 0.25, the padded position ignored
    torch.testing.assert_close(sequence_kl(logprobs, ref_logprobs, mask), torch.tensor([-0.5, 0.25]))
