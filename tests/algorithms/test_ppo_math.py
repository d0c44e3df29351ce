"""Number-by-number checks of the PPO math against values worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    explained_variance,
    gae,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from rlhf_lightning.algorithms.advantages import _gae_loop
from tests.helpers.reference_losses import reference_policy_loss, reference_value_loss

PAD = 1e6  # a loud value at padded positions: any leak into a statistic shows up at once


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-5)


def two_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0 has three valid tokens, row 1 a single-token response followed by padding."""
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, PAD, PAD]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    return values, mask


def prefix_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    return torch.arange(length)[None, :] < lengths[:, None]


# ---------------------------------------------------------------- masked statistics


def test_masked_sum_and_mean_ignore_padding():
    values, mask = two_rows()
    close(masked_sum(values, mask), 10.0)  # 1 + 2 + 3 + 4
    close(masked_mean(values, mask), 2.5)  # 10 / 4
    close(masked_sum(values, mask, dim=1), [6.0, 4.0])
    close(masked_mean(values, mask, dim=1), [2.0, 4.0])  # 6 / 3, 4 / 1
    close(masked_sum(values, mask, dim=0), [5.0, 2.0, 3.0])
    close(masked_mean(values, mask, dim=0), [2.5, 2.0, 3.0])


def test_masked_mean_accepts_a_float_mask_and_nan_padding():
    values = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    close(masked_mean(values, mask), 2.0)


def test_masked_mean_of_empty_mask_is_zero_not_nan():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[False, False], [True, False]])
    close(masked_mean(values, torch.zeros_like(mask)), 0.0)
    close(masked_mean(values, mask, dim=1), [0.0, 3.0])  # the empty row is 0, the other is 3 / 1


def test_masked_var_unbiased_and_biased():
    values, mask = two_rows()
    # mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5
    close(masked_var(values, mask), 5.0 / 3.0)
    close(masked_var(values, mask, unbiased=False), 5.0 / 4.0)


def test_masked_var_is_zero_for_one_or_no_valid_entry():
    values = torch.tensor([[7.0, PAD, PAD]])
    close(masked_var(values, torch.tensor([[True, False, False]])), 0.0)
    close(masked_var(values, torch.tensor([[False, False, False]])), 0.0)
    close(masked_var(values, torch.tensor([[False, False, False]]), unbiased=False), 0.0)


def test_masked_whiten_by_hand():
    values, mask = two_rows()
    # (x - 2.5) / sqrt(5/3): 1.5 * sqrt(3/5) = 1.161895, 0.5 * sqrt(3/5) = 0.387298
    close(masked_whiten(values, mask), [[-1.161895, -0.387298, 0.387298], [1.161895, 0.0, 0.0]])
    # shift_mean=False adds the mean 2.5 back at valid positions; padding stays 0
    close(
        masked_whiten(values, mask, shift_mean=False),
        [[1.338105, 2.112702, 2.887298], [3.661895, 0.0, 0.0]],
    )


def test_masked_whiten_output_has_zero_mean_and_unit_variance():
    values = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)) * 3 + 5
    mask = prefix_mask(torch.tensor([6, 1, 3, 4]), 6)
    white = masked_whiten(values, mask)
    close(masked_mean(white, mask), 0.0, atol=1e-5)
    close(masked_var(white, mask), 1.0, atol=1e-5)


# ---------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    logprobs = torch.tensor([[-0.5, -1.0, -2.0]])
    ref_logprobs = torch.tensor([[-1.0, -1.0, -1.5]])  # log ratio = [0.5, 0, -0.5]
    close(kl_penalty(logprobs, ref_logprobs), [[0.5, 0.0, -0.5]])  # k1 is the default
    close(kl_penalty(logprobs, ref_logprobs, "k1"), [[0.5, 0.0, -0.5]])
    close(kl_penalty(logprobs, ref_logprobs, "k2"), [[0.125, 0.0, 0.125]])
    # k3: exp(-0.5) - 1 + 0.5 = 0.1065307; exp(0.5) - 1 - 0.5 = 0.1487213
    close(kl_penalty(logprobs, ref_logprobs, "k3"), [[0.1065307, 0.0, 0.1487213]])


def test_kl_estimators_vanish_at_equal_policies():
    logprobs = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    for estimator in ("k1", "k2", "k3"):
        assert torch.equal(kl_penalty(logprobs, logprobs.clone(), estimator), torch.zeros(3, 5))


def test_k3_is_non_negative_on_random_input():
    generator = torch.Generator().manual_seed(2)
    logprobs, ref_logprobs = torch.randn(2, 64, 64, generator=generator) * 3
    assert (kl_penalty(logprobs, ref_logprobs, "k3") >= 0).all()


def test_unknown_kl_estimator_names_the_allowed_ones():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")  # type: ignore[arg-type]


def test_k1_and_k3_means_over_samples_from_pi_estimate_the_kl():
    generator = torch.Generator().manual_seed(3)
    pi = torch.tensor([0.5, 0.3, 0.2])
    pi_ref = torch.tensor([0.2, 0.3, 0.5])
    exact = float((pi * (pi / pi_ref).log()).sum())  # 0.3 * log(0.5/0.2) + 0.2 * log(0.2/0.5) = 0.2748872
    assert exact == pytest.approx(0.2748872, abs=1e-6)
    tokens = torch.multinomial(pi, 200_000, replacement=True, generator=generator)
    logprobs, ref_logprobs = pi.log()[tokens], pi_ref.log()[tokens]
    for estimator in ("k1", "k3"):
        assert float(kl_penalty(logprobs, ref_logprobs, estimator).mean()) == pytest.approx(exact, abs=0.01)


def test_fixed_kl_controller_never_moves():
    controller = FixedKLController(0.05)
    controller.update(current_kl=100.0, n_steps=10_000)
    assert controller.value == 0.05
    restored = FixedKLController(0.3)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == 0.05
    with pytest.raises(ValueError, match=">= 0"):
        FixedKLController(-0.1)


def test_adaptive_kl_controller_sequence_by_hand():
    controller = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10_000)
    controller.update(current_kl=9.0, n_steps=1_000)  # 9/6 - 1 = 0.5 -> clipped to 0.2: 0.1 * 1.02
    assert controller.value == pytest.approx(0.102, rel=1e-12)
    controller.update(current_kl=0.0, n_steps=1_000)  # 0/6 - 1 = -1 -> clipped to -0.2: * 0.98
    assert controller.value == pytest.approx(0.09996, rel=1e-12)
    controller.update(current_kl=6.6, n_steps=5_000)  # 6.6/6 - 1 = 0.1, unclipped: * (1 + 0.1 * 0.5)
    assert controller.value == pytest.approx(0.104958, rel=1e-12)
    controller.update(current_kl=6.0, n_steps=5_000)  # on target: unchanged
    assert controller.value == pytest.approx(0.104958, rel=1e-12)


def test_adaptive_kl_controller_state_dict_round_trip():
    controller = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10_000)
    controller.update(current_kl=9.0, n_steps=1_000)
    resumed = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10_000)
    resumed.load_state_dict(controller.state_dict())
    assert resumed.value == pytest.approx(0.102, rel=1e-12)
    controller.update(current_kl=3.0, n_steps=2_000)
    resumed.update(current_kl=3.0, n_steps=2_000)
    assert resumed.value == controller.value == pytest.approx(0.102 * 0.96, rel=1e-12)  # -0.2 * 0.2 = -0.04


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_coef": 0.1, "target": 0.0, "horizon": 10}, "target"),
        ({"init_coef": 0.1, "target": 6.0, "horizon": 0}, "horizon"),
        ({"init_coef": -0.1, "target": 6.0, "horizon": 10}, "coefficient"),
    ],
)
def test_adaptive_kl_controller_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveKLController(**kwargs)


# ---------------------------------------------------------------- GAE


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [2.0, PAD, PAD]])
    values = torch.tensor([[0.5, 0.4, 0.2], [1.0, PAD, PAD]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # Row 0, gamma * lam = 0.45:
    #   delta_2 = 1 - 0.2 = 0.8;  delta_1 = 0.9 * 0.2 - 0.4 = -0.22;  delta_0 = 0.9 * 0.4 - 0.5 = -0.14
    #   A_2 = 0.8;  A_1 = -0.22 + 0.45 * 0.8 = 0.14;  A_0 = -0.14 + 0.45 * 0.14 = -0.077
    # Row 1 (single token): delta_0 = 2 - 1 = 1 = A_0, return 2.
    close(advantages, [[-0.077, 0.14, 0.8], [1.0, 0.0, 0.0]])
    close(returns, [[0.423, 0.54, 1.0], [2.0, 0.0, 0.0]])


def test_gae_with_gamma_lam_one_is_monte_carlo():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, PAD, PAD]])
    values = torch.tensor([[0.5, 1.0, 1.5, 2.0], [1.0, 3.0, PAD, PAD]])
    mask = prefix_mask(torch.tensor([4, 2]), 4)
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    close(returns, [[10.0, 9.0, 7.0, 4.0], [11.0, 6.0, 0.0, 0.0]])  # rewards-to-go
    close(advantages, [[9.5, 8.0, 5.5, 2.0], [10.0, 3.0, 0.0, 0.0]])


def test_gae_with_lam_zero_is_one_step_td():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [5.0, PAD, PAD]])
    values = torch.tensor([[0.5, 1.0, 1.5], [1.0, PAD, PAD]])
    mask = prefix_mask(torch.tensor([3, 1]), 3)
    advantages, _ = gae(rewards, values, mask, gamma=0.5, lam=0.0)
    # delta_t = r_t + 0.5 * V_{t+1} - V_t: 1 + 0.5 - 0.5, 2 + 0.75 - 1, 3 - 1.5; 5 - 1
    close(advantages, [[1.0, 1.75, 1.5], [4.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7), (0.5, 1.0)]
)
def test_gae_vectorised_matches_loop_on_random_prefix_masks(gamma, lam):
    generator = torch.Generator().manual_seed(int(gamma * 100 + lam * 10))
    batch, length = 8, 13
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    lengths[0], lengths[1] = 1, length  # always include a single-token and a full-length response
    mask = prefix_mask(lengths, length)
    rewards = torch.randn(batch, length, generator=generator).masked_fill(~mask, PAD)
    values = torch.randn(batch, length, generator=generator).masked_fill(~mask, -PAD)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    expected_advantages, expected_returns = _gae_loop(rewards, values, mask, gamma, lam)
    close(advantages, expected_advantages, atol=1e-5)
    close(returns, expected_returns, atol=1e-5)
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()


def test_gae_outputs_are_zero_at_every_invalid_position_even_for_a_non_prefix_mask():
    rewards = torch.ones(1, 3)
    values = torch.full((1, 3), 0.5)
    mask = torch.tensor([[True, False, True]])  # not a PPO mask; only the zeros at invalid slots are promised
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert advantages[0, 1] == 0 and returns[0, 1] == 0


def test_gae_is_finite_for_long_responses_and_zero_decay():
    length = 2048
    rewards = torch.ones(2, length)
    values = torch.zeros(2, length)
    mask = prefix_mask(torch.tensor([length, 5]), length)
    for gamma, lam in [(0.0, 0.0), (1.0, 0.0), (0.99, 0.95)]:
        advantages, returns = gae(rewards, values, mask, gamma, lam)
        assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
    advantages, _ = gae(rewards, values, mask, gamma=1.0, lam=0.0)
    close(advantages[1, :5], [1.0] * 5)  # lam = 0: just the one-step reward, diagonal 0**0 == 1


def test_gae_upcasts_half_precision_and_rejects_bad_discounts():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.bfloat16)
    values = torch.zeros(1, 3, dtype=torch.bfloat16)
    advantages, _ = gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=0.9, lam=1.0)
    assert advantages.dtype == torch.float32
    close(advantages, [[0.81, 0.9, 1.0]])
    with pytest.raises(ValueError, match="gamma"):
        gae(rewards, values, torch.ones(1, 3), gamma=1.1, lam=0.9)


# ---------------------------------------------------------------- logits


def test_logprobs_from_logits_by_hand_and_against_log_softmax():
    # softmax([0, log 3]) = [1/4, 3/4]; log(3/4) = -0.2876821
    close(logprobs_from_logits(torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([1])), [-0.2876821])
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 11, generator=generator) * 5
    labels = torch.randint(0, 11, (2, 3), generator=generator)
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    close(logprobs_from_logits(logits, labels), expected, atol=1e-5)


def test_logprobs_from_logits_is_stable_for_huge_logits():
    # exp(1e4) overflows even float64; float64 so the only error left is the function's, not rounding of 1e4
    logits = torch.tensor([[1e4, 1e4 - 1.0, -1e4]], dtype=torch.float64)
    out = logprobs_from_logits(logits, torch.tensor([1]))
    close(out, [-1.0 - math.log1p(math.exp(-1.0))], atol=1e-9)  # log(e^-1 / (1 + e^-1)) = -1.3132617


def test_entropy_from_logits():
    close(entropy_from_logits(torch.full((2, 3, 7), 0.3)), torch.full((2, 3), math.log(7.0)))
    # p = [1/4, 3/4]: H = 0.25 * log 4 + 0.75 * log(4/3) = 0.5623351
    close(entropy_from_logits(torch.tensor([0.0, math.log(3.0)])), 0.5623351)
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(5)) * 4
    close(entropy_from_logits(logits), torch.distributions.Categorical(logits=logits).entropy(), atol=1e-5)


# ---------------------------------------------------------------- policy loss


def policy_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ratios = torch.tensor([[1.5, 0.9, 1.05], [0.5, 1.0, 1.0]])
    old_logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -3.0, -3.0]])
    logprobs = (old_logprobs + ratios.log()).requires_grad_()
    with torch.no_grad():
        logprobs[1, 1:] = 500.0  # garbage at padding: exp would overflow if it were used
    advantages = torch.tensor([[1.0, -2.0, 0.5], [-1.0, PAD, PAD]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    return logprobs, old_logprobs, advantages, mask


def test_policy_loss_by_hand():
    logprobs, old_logprobs, advantages, mask = policy_inputs()
    out = reference_policy_loss(logprobs, old_logprobs, advantages, mask, clip_range=0.2)
    # per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   r=1.5,  A=1  : max(-1.5, -1.2)  = -1.2   clipped
    #   r=0.9,  A=-2 : max(1.8, 1.8)    = 1.8
    #   r=1.05, A=.5 : max(-.525, -.525) = -0.525
    #   r=0.5,  A=-1 : max(0.5, 0.8)    = 0.8    clipped
    close(out.loss, (-1.2 + 1.8 - 0.525 + 0.8) / 4)  # 0.21875
    close(out.clipfrac, 0.5)
    # (r - 1) - log r: 0.0945349 + 0.0053605 + 0.0012098 + 0.1931472 = 0.2942524
    close(out.approx_kl, 0.2942524 / 4)
    close(out.ratio_mean, (1.5 + 0.9 + 1.05 + 0.5) / 4)
    assert out.loss.requires_grad
    assert not (out.clipfrac.requires_grad or out.approx_kl.requires_grad or out.ratio_mean.requires_grad)
    assert all(t.dim() == 0 for t in out)


def test_policy_loss_gradient_is_zero_at_clipped_tokens_only():
    logprobs, old_logprobs, advantages, mask = policy_inputs()
    reference_policy_loss(logprobs, old_logprobs, advantages, mask, clip_range=0.2).loss.backward()
    # d/dlogprob of -A r / N is -A r / N at unclipped tokens: 2 * 0.9 / 4 = 0.45, -0.5 * 1.05 / 4 = -0.13125
    close(logprobs.grad, [[0.0, 0.45, -0.13125], [0.0, 0.0, 0.0]])


def test_policy_loss_at_ratio_one():
    generator = torch.Generator().manual_seed(6)
    old_logprobs = -torch.rand(3, 4, generator=generator)
    advantages = torch.randn(3, 4, generator=generator)
    mask = prefix_mask(torch.tensor([4, 1, 2]), 4)
    out = reference_policy_loss(old_logprobs.clone(), old_logprobs, advantages, mask, clip_range=0.2)
    close(out.loss, -masked_mean(advantages, mask))
    close(out.clipfrac, 0.0)
    close(out.approx_kl, 0.0)
    close(out.ratio_mean, 1.0)


# ---------------------------------------------------------------- value loss and explained variance


def value_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # inf at padding: a masked-out token must still get a zero (not NaN) gradient
    values = torch.tensor([[1.0, 2.0, 2.5], [0.9, PAD, float("inf")]], requires_grad=True)
    old_values = torch.tensor([[1.5, 1.0, 3.5], [0.0, -PAD, -PAD]])
    returns = torch.tensor([[2.0, 1.5, 2.0], [1.0, PAD, -PAD]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    return values, old_values, returns, mask


def test_value_loss_without_clipping():
    values, old_values, returns, mask = value_inputs()
    out = reference_value_loss(values, old_values, returns, mask, clip_range_value=None)
    # (V - R)^2 = 1, 0.25, 0.25, 0.01 -> mean 0.3775 -> half 0.18875
    close(out.loss, 0.18875)
    close(out.clipfrac, 0.0)
    out.loss.backward()
    close(values.grad, [[-0.25, 0.125, 0.125], [-0.025, 0.0, 0.0]])  # (V - R) / 4


def test_value_loss_with_clipping():
    values, old_values, returns, mask = value_inputs()
    out = reference_value_loss(values, old_values, returns, mask, clip_range_value=0.2)
    # V_clip = old + clip(V - old, ±0.2) = 1.3, 1.2, 3.3, 0.2; (V_clip - R)^2 = 0.49, 0.09, 1.69, 0.64
    # max with the unclipped 1, 0.25, 0.25, 0.01 -> 1, 0.25, 1.69, 0.64: mean 0.895, half 0.4475
    close(out.loss, 0.4475)
    close(out.clipfrac, 0.5)  # the last two tokens
    out.loss.backward()
    close(values.grad, [[-0.25, 0.125, 0.0], [0.0, 0.0, 0.0]])  # no gradient through clipped tokens
    assert not out.clipfrac.requires_grad


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0], [4.0, PAD, PAD]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    values = torch.tensor([[1.0, 2.0, 3.0], [5.0, -PAD, 0.0]])
    # var(R) = 5/3; R - V = 0, 0, 0, -1 -> var 0.75 / 3 = 0.25; 1 - 0.25 / (5/3) = 0.85
    close(explained_variance(values, returns, mask), 0.85)
    close(explained_variance(returns.clone(), returns, mask), 1.0)
    flat = torch.tensor([[2.0, 2.0, 2.0], [2.0, PAD, PAD]])
    close(explained_variance(values, flat, mask), 0.0)  # var(R) == 0: defined as 0, not NaN or -inf


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_head_logprobs_match_logits_path_values_and_gradients(temperature):
    from rlhf_lightning.algorithms import entropy_from_logits, logprobs_from_logits
    from rlhf_lightning.ops.lm_head import logprobs_from_hidden

    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5))
    logprobs, entropy = logprobs_from_hidden(hidden, weight, labels, temperature, with_entropy=True)
    logits = hidden @ weight.t() / temperature
    expected = logprobs_from_logits(logits, labels)
    torch.testing.assert_close(logprobs, expected)
    torch.testing.assert_close(entropy, entropy_from_logits(logits))
    assert not entropy.requires_grad  # a statistic
    upstream = torch.randn(3, 5, dtype=torch.float64)
    got = torch.autograd.grad((logprobs * upstream).sum(), [hidden, weight], retain_graph=True)
    want = torch.autograd.grad((expected * upstream).sum(), [hidden, weight])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    again = torch.autograd.grad((logprobs * upstream).sum(), [hidden, weight])  # a retained graph still works
    for g, w in zip(again, want, strict=True):
        torch.testing.assert_close(g, w)
