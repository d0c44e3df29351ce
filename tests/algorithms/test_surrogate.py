"""Clipped surrogate (token and sequence ratio) and loss aggregation, against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning.algorithms.surrogate import (
    SurrogateOutput,
    aggregate_loss,
    cispo_surrogate,
    clipped_surrogate,
    loss_normaliser,
)

PAD = 1e6
NAN, INF = float("nan"), float("inf")


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-5)


def prefix_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    return torch.arange(length)[None, :] < lengths[:, None]


def token_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row 0 has four valid tokens, row 1 two; padding holds inf / NaN garbage in every input."""
    ratios = torch.tensor([[1.5, 0.9, 1.05, 0.7], [0.5, 1.25, 1.0, 1.0]])
    old_logprobs = torch.tensor([[-1.0, -2.0, -0.5, -1.2], [-1.5, -0.3, -INF, -1.0]])
    logprobs = old_logprobs + ratios.log()
    logprobs[1, 2:] = torch.tensor([INF, NAN])
    advantages = torch.tensor([[1.0, -2.0, 0.5, 1.0], [-1.0, 1.0, NAN, INF]])
    mask = prefix_mask(torch.tensor([4, 2]), 4)
    return logprobs.requires_grad_(), old_logprobs, advantages, mask


# ---------------------------------------------------------------- token level


def test_token_level_by_hand_with_clip_higher():
    logprobs, old_logprobs, advantages, mask = token_inputs()
    out = clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.28)
    assert isinstance(out, SurrogateOutput)
    # loss = -min(r A, clip(r, 0.8, 1.28) A):
    #   r=1.5,  A=1   : -min(1.5, 1.28)     = -1.28   high-clipped
    #   r=0.9,  A=-2  : -min(-1.8, -1.8)    = 1.8
    #   r=1.05, A=0.5 : -min(.525, .525)    = -0.525
    #   r=0.7,  A=1   : -min(0.7, 0.8)      = -0.7    below the range but A > 0: not clipped
    #   r=0.5,  A=-1  : -min(-0.5, -0.8)    = 0.8     low-clipped
    #   r=1.25, A=1   : -min(1.25, 1.25)    = -1.25   inside 1 + 0.28 (a symmetric 0.2 would clip it)
    close(out.loss, [[-1.28, 1.8, -0.525, -0.7], [0.8, -1.25, 0.0, 0.0]])
    close(out.ratio, [[1.5, 0.9, 1.05, 0.7], [0.5, 1.25, 1.0, 1.0]])  # 1 at padding
    assert out.clipped_low.tolist() == [[False, False, False, False], [True, False, False, False]]
    assert out.clipped_high.tolist() == [[True, False, False, False], [False, False, False, False]]
    assert out.loss.requires_grad and not out.ratio.requires_grad
    assert out.clipped_low.dtype == out.clipped_high.dtype == torch.bool


def test_symmetric_clip_clips_the_high_ratio_that_clip_higher_keeps():
    logprobs, old_logprobs, advantages, mask = token_inputs()
    out = clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2)
    close(out.loss[1, :2], [0.8, -1.2])  # -min(1.25, 1.2)
    assert out.clipped_high[1].tolist() == [False, True, False, False]


def test_token_level_gradient_is_minus_advantage_times_ratio_unless_clipped():
    logprobs, old_logprobs, advantages, mask = token_inputs()
    out = clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.28)
    out.loss.sum().backward()
    # d(-r A)/d lp = -A r: 2 * 0.9 = 1.8, -0.5 * 1.05 = -0.525, -1 * 0.7 = -0.7, -1 * 1.25 = -1.25
    # the two clipped tokens and the padding get exactly 0
    close(logprobs.grad, [[0.0, 1.8, -0.525, -0.7], [0.0, -1.25, 0.0, 0.0]])
    clipped = out.clipped_low | out.clipped_high
    expected = torch.where(mask & ~clipped, -advantages * out.ratio, torch.zeros(()))
    close(logprobs.grad, expected)


def test_ratio_one_gives_the_policy_gradient():
    # one update pass per rollout: lp_old = lp.detach(), the loss value is -A and its gradient -A
    generator = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(3, 5, generator=generator)).requires_grad_()
    advantages = torch.randn(3, 5, generator=generator)
    mask = prefix_mask(torch.tensor([5, 1, 3]), 5)
    for level in ("token", "sequence"):
        out = clipped_surrogate(logprobs, logprobs.detach(), advantages, mask, 0.2, 0.2, level=level)
        close(out.loss, torch.where(mask, -advantages, torch.zeros(())))
        assert not (out.clipped_low.any() or out.clipped_high.any())
        (grad,) = torch.autograd.grad(out.loss.sum(), logprobs)
        if level == "token":
            close(grad, torch.where(mask, -advantages, torch.zeros(())))
        else:  # every token of a row carries the row's mean of -A_t, each through 1/L of the log-ratio
            row_mean = (torch.where(mask, -advantages, torch.zeros(())).sum(1) / mask.sum(1)).unsqueeze(1)
            close(grad, torch.where(mask, row_mean.expand(-1, 5), torch.zeros(())), atol=1e-5)


# ---------------------------------------------------------------- sequence level (GSPO)


def sequence_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token log-ratios: row 0 [0.3, -0.1, 0.1] (mean 0.1), row 1 [log 0.5] (one token), row 2 [0.6, 0.4]."""
    log_ratios = torch.tensor([[0.3, -0.1, 0.1], [math.log(0.5), 0.0, 0.0], [0.6, 0.4, 0.0]])
    old_logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, NAN, -INF], [-1.5, -0.2, 3.0]])
    logprobs = old_logprobs + log_ratios
    logprobs[1, 1:] = torch.tensor([PAD, INF])
    logprobs[2, 2] = NAN
    # a sequence advantage broadcast over its tokens, garbage at padding
    advantages = torch.tensor([[2.0, 2.0, 2.0], [-1.0, NAN, NAN], [1.0, 1.0, -INF]])
    mask = prefix_mask(torch.tensor([3, 1, 2]), 3)
    return logprobs.requires_grad_(), old_logprobs, advantages, mask


def test_sequence_level_ratio_and_clip_flags_by_hand():
    logprobs, old_logprobs, advantages, mask = sequence_inputs()
    out = clipped_surrogate(logprobs, old_logprobs, advantages, mask, 0.2, 0.28, level="sequence")
    # rho: exp(0.1) = 1.1051709, exp(log 0.5) = 0.5, exp(0.5) = 1.6487213, each on its row's tokens
    close(out.ratio, [[1.1051709] * 3, [0.5, 1.0, 1.0], [1.6487213, 1.6487213, 1.0]])
    # row 0, A = 2 inside [0.8, 1.28]: -2.2103418; row 1, A = -1 below 0.8: -(-0.8) = 0.8 (low-clipped);
    # row 2, A = 1 above 1.28: -1.28 (high-clipped)
    close(out.loss, [[-2.2103418] * 3, [0.8, 0.0, 0.0], [-1.28, -1.28, 0.0]])
    assert out.clipped_low.tolist() == [[False] * 3, [True, False, False], [False] * 3]
    assert out.clipped_high.tolist() == [[False] * 3, [False] * 3, [True, True, False]]


def test_token_and_sequence_levels_differ_on_the_same_inputs():
    logprobs, old_logprobs, advantages, mask = sequence_inputs()
    out = clipped_surrogate(logprobs, old_logprobs, advantages, mask, 0.2, 0.28, level="token")
    # row 0 token ratios exp(0.3) = 1.3498588 (> 1.28, A > 0: clipped), exp(-0.1) = 0.9048374, 1.1051709
    close(out.ratio[0], [1.3498588, 0.9048374, 1.1051709])
    close(out.loss[0], [-2.56, -1.8096748, -2.2103418])
    assert out.clipped_high[0].tolist() == [True, False, False]  # the sequence ratio clipped nothing in row 0
    # row 2 token ratios exp(0.6) = 1.8221188, exp(0.4) = 1.4918247: both clipped, as at sequence level
    close(out.ratio[2, :2], [1.8221188, 1.4918247])
    assert out.clipped_high[2].tolist() == [True, True, False]


def test_sequence_level_gradient_spreads_minus_advantage_times_ratio_over_the_row():
    logprobs, old_logprobs, advantages, mask = sequence_inputs()
    out = clipped_surrogate(logprobs, old_logprobs, advantages, mask, 0.2, 0.28, level="sequence")
    out.loss.sum().backward()
    # row 0: three tokens each carry -A rho, and d rho / d lp_s = rho / 3, so each lp_s gets
    # 3 * (-2 * 1.1051709 / 3) = -2.2103418; rows 1 and 2 are clipped; padding is exactly 0
    close(logprobs.grad, [[-2.2103418] * 3, [0.0] * 3, [0.0] * 3])


def test_gspo_sequence_mean_is_the_mean_over_responses_of_the_clipped_objective():
    logprobs, old_logprobs, advantages, mask = sequence_inputs()
    out = clipped_surrogate(logprobs, old_logprobs, advantages, mask, 0.2, 0.28, level="sequence")
    loss = aggregate_loss(out.loss, mask, "sequence_mean", loss_normaliser(mask, "sequence_mean"))
    close(loss, (-2.2103418 + 0.8 - 1.28) / 3)  # GSPO: (1/G) sum_i -min(s_i A_i, clip(s_i) A_i)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_garbage_at_padding_gives_finite_loss_and_zero_gradients(level):
    logprobs, old_logprobs, advantages, mask = token_inputs()
    out = clipped_surrogate(logprobs, old_logprobs, advantages, mask, 0.2, 0.28, level=level)
    assert torch.isfinite(out.loss).all() and torch.isfinite(out.ratio).all()
    assert (out.loss[~mask] == 0).all()
    assert not (out.clipped_low[~mask].any() or out.clipped_high[~mask].any())
    for mode in ("token_mean", "sequence_mean", "constant"):
        loss = aggregate_loss(out.loss, mask, mode, loss_normaliser(mask, mode, max_length=4))
        (grad,) = torch.autograd.grad(loss, logprobs, retain_graph=True)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert (grad[~mask] == 0).all()
        assert (grad[mask] != 0).any()


def test_surrogate_upcasts_bf16_and_rejects_bad_arguments():
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    out = clipped_surrogate(logprobs, logprobs.detach(), torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.2)
    assert out.loss.dtype == torch.float32
    out.loss.sum().backward()
    assert logprobs.grad.dtype == torch.bfloat16
    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match=">= 0"):
        clipped_surrogate(*args, clip_low=-0.1, clip_high=0.2)
    with pytest.raises(ValueError, match=">= 0"):
        clipped_surrogate(*args, clip_low=0.2, clip_high=-0.2)
    with pytest.raises(ValueError, match="token, sequence"):
        clipped_surrogate(*args, 0.2, 0.2, level="sequence_token")  # type: ignore[arg-type]


# ---------------------------------------------------------------- aggregation


def unequal_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of 5, 4, 1 and 2 valid tokens, sums 15, 8, 10, 8 and token means 3, 2, 10, 4; inf at padding."""
    per_token = torch.tensor(
        [
            [1.0, 2.0, 3.0, 4.0, 5.0],
            [2.0, 2.0, 2.0, 2.0, INF],
            [10.0, INF, -INF, NAN, PAD],
            [3.0, 5.0, NAN, INF, INF],
        ]
    )
    return per_token.requires_grad_(), prefix_mask(torch.tensor([5, 4, 1, 2]), 5)


def test_loss_normaliser_by_hand():
    _, mask = unequal_rows()
    close(loss_normaliser(mask, "token_mean"), 12.0)
    close(loss_normaliser(mask, "sequence_mean"), 4.0)
    close(loss_normaliser(mask, "constant", max_length=8), 32.0)
    close(loss_normaliser(mask[:1], "constant", max_length=8), 8.0)
    for mode in ("token_mean", "sequence_mean"):
        value = loss_normaliser(mask.float(), mode)
        assert value.dim() == 0 and value.dtype == torch.float32
    with pytest.raises(ValueError, match="max_length"):
        loss_normaliser(mask, "constant")
    with pytest.raises(ValueError, match="max_length"):
        loss_normaliser(mask, "constant", max_length=0)
    with pytest.raises(ValueError, match="token_mean, sequence_mean, constant"):
        loss_normaliser(mask, "mean")  # type: ignore[arg-type]


def test_aggregate_loss_on_one_batch_by_hand():
    per_token, mask = unequal_rows()
    close(aggregate_loss(per_token, mask, "token_mean", loss_normaliser(mask, "token_mean")), 41.0 / 12.0)
    # the mean of per-row token means: (3 + 2 + 10 + 4) / 4 = 4.75
    close(aggregate_loss(per_token, mask, "sequence_mean", loss_normaliser(mask, "sequence_mean")), 4.75)
    close(aggregate_loss(per_token, mask, "constant", loss_normaliser(mask, "constant", 5)), 41.0 / 20.0)
    close(aggregate_loss(per_token, mask, "constant", loss_normaliser(mask, "constant", 8)), 41.0 / 32.0)
    with pytest.raises(ValueError, match="token_mean, sequence_mean, constant"):
        aggregate_loss(per_token, mask, "sum", 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "expected", "naive"),
    [
        # micro-batches rows [0, 1] (9 tokens, sum 23) and [2, 3] (3 tokens, sum 18)
        # token means averaged: (23/9 + 18/3) / 2 = 4.2777778, not 41/12 = 3.4166667
        ("token_mean", 41.0 / 12.0, (23.0 / 9.0 + 6.0) / 2.0),
        # one micro-batch of 3 rows [0, 1, 2] and one of 1 row [3]: ((3+2+10)/3 + 4) / 2 = 4.5, not 4.75
        ("sequence_mean", 4.75, 4.5),
        # micro-batches of 3 and 1 rows: (33/15 + 8/5) / 2 = 1.9, not 41/20 = 2.05
        ("constant", 41.0 / 20.0, 1.9),
    ],
)
def test_micro_batches_summed_with_the_total_normaliser_equal_the_whole_batch(mode, expected, naive):
    per_token, mask = unequal_rows()
    split = 2 if mode == "token_mean" else 3
    parts = [(per_token[:split], mask[:split]), (per_token[split:], mask[split:])]
    whole = aggregate_loss(per_token, mask, mode, loss_normaliser(mask, mode, max_length=5))
    close(whole, expected)
    (whole_grad,) = torch.autograd.grad(whole, per_token)

    total = sum(loss_normaliser(m, mode, max_length=5) for _, m in parts)
    accumulated = sum(aggregate_loss(p, m, mode, total) for p, m in parts)
    close(accumulated, expected)
    (accumulated_grad,) = torch.autograd.grad(accumulated, per_token)
    close(accumulated_grad, whole_grad)
    assert torch.isfinite(whole_grad).all()

    # what averaging per-micro-batch losses (each with its own normaliser) would give instead
    own = [aggregate_loss(p, m, mode, loss_normaliser(m, mode, max_length=5)) for p, m in parts]
    close((own[0] + own[1]) / 2, naive)
    assert abs(float((own[0] + own[1]).detach()) / 2 - expected) > 0.1


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "constant"])
def test_random_micro_batch_splits_match_the_whole_batch(mode):
    generator = torch.Generator().manual_seed(7)
    batch, length = 9, 12
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = prefix_mask(lengths, length)
    per_token = torch.randn(batch, length, generator=generator).masked_fill(~mask, INF)
    whole = aggregate_loss(per_token, mask, mode, loss_normaliser(mask, mode, max_length=16))
    for cuts in ([0, 1, 9], [0, 4, 5, 9], [0, 2, 3, 7, 9]):
        parts = [(per_token[a:b], mask[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        total = sum(loss_normaliser(m, mode, max_length=16) for _, m in parts)
        close(sum(aggregate_loss(p, m, mode, total) for p, m in parts), whole, atol=1e-5)


def test_sequence_mean_is_the_mean_of_per_row_token_means():
    generator = torch.Generator().manual_seed(8)
    lengths = torch.tensor([1, 6, 3, 2, 6])
    mask = prefix_mask(lengths, 6)
    per_token = torch.randn(5, 6, generator=generator)
    row_means = [float(per_token[i, : lengths[i]].mean()) for i in range(5)]
    loss = aggregate_loss(per_token, mask, "sequence_mean", loss_normaliser(mask, "sequence_mean"))
    close(loss, sum(row_means) / 5)
    token_mean = aggregate_loss(per_token, mask, "token_mean", loss_normaliser(mask, "token_mean"))
    close(token_mean, float(per_token[mask].mean()))
    assert abs(float(loss - token_mean)) > 1e-3  # unequal lengths: the two means are different quantities


def test_empty_rows_and_an_empty_step_give_zero_not_nan():
    per_token = torch.tensor([[1.0, 2.0], [INF, NAN]])
    mask = torch.tensor([[True, True], [False, False]])
    # the empty row counts as a sequence with mean 0: (1.5 + 0) / 2
    close(aggregate_loss(per_token, mask, "sequence_mean", loss_normaliser(mask, "sequence_mean")), 0.75)
    empty = torch.zeros(2, 2, dtype=torch.bool)
    for mode in ("token_mean", "sequence_mean"):
        loss = aggregate_loss(per_token, empty, mode, loss_normaliser(empty, mode))
        assert loss.item() == 0.0
    close(aggregate_loss(per_token, empty, "token_mean", 0.0), 0.0)
    close(aggregate_loss(per_token, mask, "token_mean", 4), 0.75)  # a plain number works as the normaliser


def trl_cispo_per_token_loss(per_token_logps, old_per_token_logps, advantages, epsilon_high):
    """TRL 1.16 GRPOTrainer._compute_loss, loss_type="cispo", token level, as its lines read."""
    log_ratio = per_token_logps - old_per_token_logps
    coef_1 = torch.exp(log_ratio)
    clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
    return -clamped_ratios * advantages * per_token_logps


def test_cispo_matches_trls_lines_and_the_papers_formula_number_by_number():
    torch.manual_seed(0)
    logprobs = (torch.randn(4, 6) - 2).requires_grad_()
    old_logprobs = logprobs.detach() + torch.randn(4, 6)  # ratios from ~0.1 to ~10: both bounds bite
    advantages = torch.tensor([[1.0], [-0.5], [2.0], [-1.5]]).expand(4, 6)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 5:] = False
    out = cispo_surrogate(logprobs, old_logprobs, advantages, mask, max_weight=2.0)
    expected = trl_cispo_per_token_loss(logprobs, old_logprobs, advantages, 2.0)
    torch.testing.assert_close(out.loss[mask], expected[mask])
    assert out.loss[~mask].eq(0).all()
    # the gradient of every token, clipped or not: -w A (the weight is detached)
    out.loss.sum().backward()
    weight = torch.exp(logprobs.detach() - old_logprobs).clamp(max=2.0)
    torch.testing.assert_close(logprobs.grad, torch.where(mask, -weight * advantages, 0.0))
    ratio = torch.exp(logprobs.detach() - old_logprobs)
    assert torch.equal(out.clipped_high, (ratio > 2.0) & (advantages > 0) & mask) and out.clipped_high.any()
    # MiniMax-M1's form: clip(r, 1 - eps_low, 1 + eps_high), here eps_low 0.6, eps_high 1.0
    paper = cispo_surrogate(logprobs.detach(), old_logprobs, advantages, mask, max_weight=2.0, min_weight=0.4)
    by_formula = -torch.clamp(ratio, 1 - 0.6, 1 + 1.0) * advantages * logprobs.detach()
    torch.testing.assert_close(paper.loss[mask], by_formula[mask])
    assert torch.equal(paper.clipped_low, (ratio < 0.4) & (advantages < 0) & mask) and paper.clipped_low.any()
    with pytest.raises(ValueError, match="0 <= min_weight < max_weight"):
        cispo_surrogate(logprobs, old_logprobs, advantages, mask, max_weight=1.0, min_weight=1.5)
