"""Group advantages of the critic-free family, number by number against values worked out in the comments."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.algorithms.group import (
    broadcast_to_tokens,
    group_advantages,
    returns_to_go,
    rloo_advantages,
    zero_std_fraction,
)

PAD = 1e6  # a loud value at padded positions: any leak into a sum shows up at once
REWARDS = [1.0, 2.0, 3.0, 6.0]


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-5)


def prefix_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    return torch.arange(length)[None, :] < lengths[:, None]


def _returns_to_go_loop(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reference by the backward recursion G_t = r_t + gamma * G_{t+1}, with G = 0 past the last valid token."""
    returns = torch.zeros(token_rewards.shape, dtype=torch.float64)
    following = torch.zeros(token_rewards.shape[0], dtype=torch.float64)
    for t in reversed(range(token_rewards.shape[1])):
        current = token_rewards[:, t].double() + gamma * following
        following = torch.where(mask[:, t], current, torch.zeros_like(current))
        returns[:, t] = following
    return returns


# ---------------------------------------------------------------- GRPO / Dr. GRPO


def test_group_scale_by_hand_two_groups_of_two():
    # groups [1, 2] and [3, 6]: means 1.5 and 4.5, centred [-0.5, 0.5] and [-1.5, 1.5]
    # Bessel std: sqrt(0.5 / 1) = 0.7071068 and sqrt(4.5 / 1) = 2.1213203
    # 0.5 / (0.7071068 + 1e-4) = 0.7070068;  1.5 / (2.1213203 + 1e-4) = 0.7070734 (eps makes them differ)
    advantages = group_advantages(torch.tensor(REWARDS), group_size=2)
    close(advantages, [-0.7070068, 0.7070068, -0.7070734, 0.7070734])
    close(group_advantages(torch.tensor(REWARDS), 2, "group", eps=0.0), [-0.7071068, 0.7071068] * 2)


def test_group_scale_by_hand_one_group_of_four_uses_bessel_std():
    # mean 3, centred [-2, -1, 0, 3], squared 4 + 1 + 0 + 9 = 14
    # unbiased std sqrt(14 / 3) = 2.1602469 (the biased sqrt(14 / 4) = 1.8708287 would give -1.069 first)
    # x / (2.1602469 + 1e-4): -0.9257772, -0.4628886, 0, 1.3886659
    advantages = group_advantages(torch.tensor(REWARDS), group_size=4)
    close(advantages, [-0.9257772, -0.4628886, 0.0, 1.3886659])


def test_batch_scale_by_hand():
    # centred on the group means as in "group", divided by the std of all four rewards, 2.1602469 (above)
    # G = 2: [-0.5, 0.5, -1.5, 1.5] / 2.1603469 = +-0.2314443, +-0.6943329
    close(group_advantages(torch.tensor(REWARDS), 2, "batch"), [-0.2314443, 0.2314443, -0.6943329, 0.6943329])
    # G = 4: one group, so batch std == group std and both scales agree
    close(group_advantages(torch.tensor(REWARDS), 4, "batch"), [-0.9257772, -0.4628886, 0.0, 1.3886659])


def test_none_scale_is_dr_grpo_centring_only():
    close(group_advantages(torch.tensor(REWARDS), 2, "none"), [-0.5, 0.5, -1.5, 1.5])
    close(group_advantages(torch.tensor(REWARDS), 4, "none"), [-2.0, -1.0, 0.0, 3.0])
    # eps only guards a division, and "none" divides by nothing
    close(group_advantages(torch.tensor(REWARDS), 4, "none", eps=123.0), [-2.0, -1.0, 0.0, 3.0])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_of_one_gives_zero_advantage_not_nan(scale):
    advantages = group_advantages(torch.tensor([1.0, 5.0, -3.0]), group_size=1, scale=scale)
    assert torch.equal(advantages, torch.zeros(3))
    close(zero_std_fraction(torch.tensor([1.0, 5.0, -3.0]), 1), 1.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_groups_give_zero_advantage_and_are_counted(scale):
    # groups [1, 1], [2, 3], [5, 5], [0, 0]: three of four have no spread
    rewards = torch.tensor([1.0, 1.0, 2.0, 3.0, 5.0, 5.0, 0.0, 0.0])
    advantages = group_advantages(rewards, 2, scale)
    assert torch.equal(advantages[[0, 1, 4, 5, 6, 7]], torch.zeros(6))
    assert (advantages[2] < 0) and (advantages[3] > 0)
    close(zero_std_fraction(rewards, 2), 0.75)
    close(zero_std_fraction(rewards, 4), 0.0)  # [1, 1, 2, 3] and [5, 5, 0, 0] both vary
    close(zero_std_fraction(torch.full((6,), 0.3), 3), 1.0)


def test_zero_std_fraction_is_a_float_scalar_without_grad():
    rewards = torch.tensor([1.0, 1.0, 2.0, 3.0], requires_grad=True)
    fraction = zero_std_fraction(rewards, 2)
    assert fraction.dim() == 0 and fraction.dtype == torch.float32 and not fraction.requires_grad
    close(fraction, 0.5)


@pytest.mark.parametrize("group_size", [2, 3, 5])
def test_group_scale_matches_formula_on_random_rewards(group_size):
    generator = torch.Generator().manual_seed(group_size)
    rewards = torch.randn(4 * group_size, generator=generator, dtype=torch.float64) * 3
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(1, keepdim=True)
    expected_group = (grouped - mean) / (grouped.std(1, unbiased=True, keepdim=True) + 1e-4)
    expected_batch = (grouped - mean) / (rewards.std(unbiased=True) + 1e-4)
    close(group_advantages(rewards, group_size), expected_group.reshape(-1))
    close(group_advantages(rewards, group_size, "batch"), expected_batch.reshape(-1))
    close(group_advantages(rewards, group_size, "none"), (grouped - mean).reshape(-1))
    # every mode leaves each group's advantages summing to 0
    close(group_advantages(rewards, group_size).view(-1, group_size).sum(1), torch.zeros(4), atol=1e-9)


def test_group_advantages_upcast_low_precision_and_integer_rewards():
    assert group_advantages(torch.tensor([0, 1, 1, 1]), 2).dtype == torch.float32
    low = group_advantages(torch.tensor(REWARDS, dtype=torch.bfloat16), 2, "none")
    assert low.dtype == torch.float32
    close(low, [-0.5, 0.5, -1.5, 1.5])
    assert group_advantages(torch.tensor(REWARDS, dtype=torch.float64), 2).dtype == torch.float64


def test_group_functions_reject_bad_shapes_and_sizes():
    rewards = torch.tensor(REWARDS)
    for function in (group_advantages, rloo_advantages, zero_std_fraction):
        with pytest.raises(ValueError, match="multiple of group_size"):
            function(rewards, 3)
        with pytest.raises(ValueError, match="group_size must be >= 1"):
            function(rewards, 0)
        with pytest.raises(ValueError, match="1-D"):
            function(rewards.view(2, 2), 2)
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(rewards, 2, "std")  # type: ignore[arg-type]


# ---------------------------------------------------------------- RLOO


def test_rloo_by_hand():
    # G = 2: the baseline is the other sample: [1 - 2, 2 - 1, 3 - 6, 6 - 3]
    close(rloo_advantages(torch.tensor(REWARDS), 2), [-1.0, 1.0, -3.0, 3.0])
    # G = 4: 1 - 11/3, 2 - 10/3, 3 - 9/3, 6 - 6/3 = -8/3, -4/3, 0, 4
    close(rloo_advantages(torch.tensor(REWARDS), 4), [-8.0 / 3.0, -4.0 / 3.0, 0.0, 4.0])


@pytest.mark.parametrize("group_size", [2, 3, 4, 7])
def test_rloo_equals_scaled_dr_grpo(group_size):
    rewards = torch.randn(3 * group_size, generator=torch.Generator().manual_seed(10 + group_size))
    expected = group_size / (group_size - 1) * group_advantages(rewards, group_size, "none")
    close(rloo_advantages(rewards, group_size), expected, atol=1e-5)


def test_rloo_needs_two_samples_and_gives_zero_for_equal_rewards():
    with pytest.raises(ValueError, match="leave-one-out"):
        rloo_advantages(torch.tensor(REWARDS), 1)
    assert torch.equal(rloo_advantages(torch.full((6,), 2.5), 3), torch.zeros(6))


# ---------------------------------------------------------------- returns to go


def padded_rewards() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of 4, 2 and 1 (a single-token response) valid tokens; padding holds a loud value."""
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, PAD, PAD], [7.0, PAD, -PAD, PAD]])
    return rewards, prefix_mask(torch.tensor([4, 2, 1]), 4)


def test_returns_to_go_undiscounted_by_hand():
    rewards, mask = padded_rewards()
    # reversed cumulative sums of the valid part: 4+3+2+1, 4+3+2, 4+3, 4; 6+5, 6; 7
    close(returns_to_go(rewards, mask), [[10.0, 9.0, 7.0, 4.0], [11.0, 6.0, 0.0, 0.0], [7.0, 0.0, 0.0, 0.0]])


def test_returns_to_go_discounted_by_hand():
    rewards, mask = padded_rewards()
    # gamma 0.5, G_t = r_t + 0.5 G_{t+1}: row 0 G_3 = 4, G_2 = 3 + 2 = 5, G_1 = 2 + 2.5 = 4.5, G_0 = 1 + 2.25
    # row 1: G_1 = 6, G_0 = 5 + 3 = 8; row 2: 7
    expected = [[3.25, 4.5, 5.0, 4.0], [8.0, 6.0, 0.0, 0.0], [7.0, 0.0, 0.0, 0.0]]
    close(returns_to_go(rewards, mask, gamma=0.5), expected)
    # gamma 0: each token keeps its own reward (0 ** 0 == 1 on the diagonal)
    expected_zero = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 0.0, 0.0, 0.0]]
    close(returns_to_go(rewards, mask, gamma=0.0), expected_zero)


@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.5, 0.0])
def test_returns_to_go_matches_loop_on_random_prefix_masks(gamma):
    generator = torch.Generator().manual_seed(int(gamma * 100))
    batch, length = 7, 11
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    lengths[0], lengths[1] = 1, length
    mask = prefix_mask(lengths, length)
    rewards = torch.randn(batch, length, generator=generator).masked_fill(~mask, float("inf"))
    returns = returns_to_go(rewards, mask, gamma)
    close(returns, _returns_to_go_loop(rewards, mask, gamma).float(), atol=1e-5)
    assert (returns[~mask] == 0).all() and torch.isfinite(returns).all()


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_returns_to_go_is_zero_at_every_invalid_position_even_for_a_non_prefix_mask(gamma):
    # not a response mask (those are prefixes); only the zeros at invalid slots are promised here
    returns = returns_to_go(torch.ones(1, 3), torch.tensor([[True, False, True]]), gamma)
    assert returns[0, 1] == 0 and returns[0, 2] == 1


def test_returns_to_go_reinforce_plus_plus_shape_of_rewards():
    # sequence reward 1 on the last token, a KL penalty of -0.1 on every token: G_t = 1 - 0.1 * (L - t)
    mask = prefix_mask(torch.tensor([3, 1]), 3)
    token_rewards = torch.full((2, 3), -0.1)
    token_rewards[0, 2] += 1.0
    token_rewards[1, 0] += 1.0
    close(returns_to_go(token_rewards, mask), [[0.7, 0.8, 0.9], [0.9, 0.0, 0.0]])


def test_returns_to_go_upcasts_and_rejects_bad_gamma():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.bfloat16)
    returns = returns_to_go(rewards, torch.ones(1, 3, dtype=torch.bool), gamma=0.9)
    assert returns.dtype == torch.float32
    close(returns, [[0.81, 0.9, 1.0]])
    for gamma in (-0.1, 1.5):
        with pytest.raises(ValueError, match="gamma"):
            returns_to_go(rewards, torch.ones(1, 3), gamma=gamma)


def test_returns_to_go_finite_on_long_responses():
    length = 1024
    mask = prefix_mask(torch.tensor([length, 3]), length)
    for gamma in (1.0, 0.9):
        returns = returns_to_go(torch.ones(2, length), mask, gamma)
        assert torch.isfinite(returns).all()
    close(returns_to_go(torch.ones(2, length), mask)[:, 0], [float(length), 3.0])
    close(returns_to_go(torch.ones(2, length), mask, 0.9)[0, 0], 10.0, atol=1e-4)  # 1 / (1 - 0.9)


# ---------------------------------------------------------------- broadcast


def test_broadcast_to_tokens_by_hand_and_its_gradient():
    values = torch.tensor([2.0, -1.0, 0.5], requires_grad=True)
    mask = prefix_mask(torch.tensor([3, 1, 2]), 3)
    tokens = broadcast_to_tokens(values, mask)
    close(tokens, [[2.0, 2.0, 2.0], [-1.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    tokens.sum().backward()
    close(values.grad, [3.0, 1.0, 2.0])  # each value counted once per valid token


def test_broadcast_to_tokens_accepts_a_float_mask_and_rejects_mismatched_shapes():
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    close(broadcast_to_tokens(torch.tensor([3.0, 4.0]), mask), [[3.0, 0.0], [4.0, 4.0]])
    with pytest.raises(ValueError, match=r"values \[B\]"):
        broadcast_to_tokens(torch.tensor([1.0, 2.0, 3.0]), mask)
    with pytest.raises(ValueError, match=r"values \[B\]"):
        broadcast_to_tokens(torch.ones(2, 1), mask)


def test_grpo_pipeline_rewards_to_token_advantages():
    rewards = torch.tensor(REWARDS)
    mask = prefix_mask(torch.tensor([2, 1, 3, 1]), 3)
    tokens = broadcast_to_tokens(group_advantages(rewards, 2, "none"), mask)
    close(tokens, [[-0.5, -0.5, 0.0], [0.5, 0.0, 0.0], [-1.5, -1.5, -1.5], [1.5, 0.0, 0.0]])
