"""The pure functions that shape a rollout, checked by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_lightning.algorithms import token_rewards
from rlhf_lightning.core.experience import Experience, ShapedRewards, sequence_kl
from rlhf_lightning.rewards.inputs import close_responses, last_token_index
from rlhf_lightning.rollout.settings import stopped, truncate_after_stop
from rlhf_lightning.stages.ppo import CriticExperience

STOP, PAD = 1, 0


def test_truncate_after_the_first_stop_token_keeps_it():
    responses = torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [1, 9, 9, 9]])
    cut, mask = truncate_after_stop(responses, STOP, PAD)
    assert cut.tolist() == [[5, 1, 0, 0], [5, 6, 7, 8], [1, 0, 0, 0]]
    assert mask.tolist() == [[True, True, False, False], [True] * 4, [True, False, False, False]]
    assert stopped(cut, mask, STOP).tolist() == [True, False, True]
    # without a stop token every token counts and nothing "stopped"
    cut, mask = truncate_after_stop(responses, None, PAD)
    assert mask.all() and torch.equal(cut, responses)
    assert stopped(cut, mask, None).tolist() == [False, False, False]


def test_last_token_index_with_left_padded_prompts_and_right_padded_responses():
    attention = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]])
    assert last_token_index(attention).tolist() == [3, 4, 2]


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


def test_close_responses_appends_the_end_token_only_where_missing():
    ids = torch.tensor([[0, 5, 6, STOP], [5, 6, 7, 8], [0, 5, 9, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 0]])
    closed, closed_mask, last = close_responses(ids, mask, end_token_id=STOP)
    assert last.tolist() == [3, 4, 3]
    assert closed.tolist() == [[0, 5, 6, 1, 1], [5, 6, 7, 8, 1], [0, 5, 9, 1, 1]]
    assert closed_mask.tolist() == [[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]


def test_close_responses_with_an_end_token_per_row_and_other_stop_tokens():
    turn_end = 3
    ids = torch.tensor([[5, 6, turn_end], [5, 6, STOP], [5, 6, 7], [5, 6, 7]])
    mask = torch.ones_like(ids)
    ends = torch.tensor([turn_end, turn_end, turn_end, STOP])  # conversations end turns with 3, text with EOS
    closed, _, last = close_responses(ids, mask, ends, stop_token_ids=(STOP, turn_end))
    assert last.tolist() == [2, 2, 3, 3]  # a response that stopped with either stop token is not closed again
    assert closed[:, :4].tolist() == [[5, 6, 3, 3], [5, 6, 1, 3], [5, 6, 7, 3], [5, 6, 7, 1]]


def test_several_stop_tokens_each_end_a_response():
    responses = torch.tensor([[5, 3, 7, 1], [5, 1, 3, 8], [5, 6, 7, 8]])
    cut, mask = truncate_after_stop(responses, (STOP, 3), PAD)
    assert cut.tolist() == [[5, 3, 0, 0], [5, 1, 0, 0], [5, 6, 7, 8]]
    assert stopped(cut, mask, (STOP, 3)).tolist() == [True, True, False]
    assert stopped(cut, mask, ()).tolist() == [False, False, False]


def test_sequence_kl_sums_the_log_ratio_over_response_tokens_only():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -3.0], [-1.0, -0.25, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # row 0: 0.5 - 1.0 + 0 ; row 1: 0.5 - 0.25, the padded position ignored
    torch.testing.assert_close(sequence_kl(logprobs, ref_logprobs, mask), torch.tensor([-0.5, 0.25]))
