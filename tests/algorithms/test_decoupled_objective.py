"""The decoupled PPO objective of asynchronous RL (AReaL, Fu et al. 2025) is the registered ``Clip`` loss
(``clip_against: proximal``) given the rollout correction's weights in its input, number for number: the clip is
against the proximal policy (the trainer's log-probs at the start of the update), and each token's loss is weighted
by the behaviour importance weight w = pi_prox / mu (mu: the sampler's log-probs), detached.

- the formula in the async-training issue, ``w = sg(min(pi_prox / mu, C))``: ``correction: {mode: token_truncate,
  max_weight: C}``;
- AReaL's ``ppo_actor_loss_fn`` with ``behav_imp_weight_cap: C`` (its tokens whose weight exceeds C count 0, their
  positions still in the token mean's denominator): ``correction: {mode: token_mask, max_weight: C}``.

The reference lines below are written from those definitions, independently of the package's code."""

from __future__ import annotations

import torch

from rlhf_lightning.algorithms.policy_losses import Clip, PolicyLossInput
from rlhf_lightning.algorithms.rollout_correction import RolloutCorrection

EPSILON, CAP = 0.2, 2.0


def tensors(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Log-probs of the current policy (a leaf with a gradient), the proximal and the behaviour policy, advantages
    and a mask with padding: stale enough that some behaviour weights exceed the cap and some ratios are clipped."""
    generator = torch.Generator().manual_seed(seed)
    shape = (4, 7)
    proximal = -torch.rand(shape, generator=generator, dtype=torch.float64) * 3
    behaviour = proximal + torch.randn(shape, generator=generator, dtype=torch.float64) * 0.8
    current = (proximal + torch.randn(shape, generator=generator, dtype=torch.float64) * 0.3).requires_grad_()
    advantages = torch.randn(shape, generator=generator, dtype=torch.float64)
    mask = torch.ones(shape, dtype=torch.bool)
    mask[0, 5:], mask[2, 3:] = False, False
    return current, proximal, behaviour, advantages, mask


def reference_decoupled(current, proximal, behaviour, advantages, mask, cap, filter_above_cap):
    """-w * min(r A, clip(r, 1 - eps, 1 + eps) A), r = pi / pi_prox, w = pi_prox / mu (capped or filtered), averaged
    over the mask's tokens."""
    ratio = torch.exp(current - proximal)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - EPSILON, 1 + EPSILON) * advantages)
    weight = torch.exp(proximal - behaviour).detach()
    weight = torch.where(weight > cap, 0.0, weight) if filter_above_cap else weight.clamp(max=cap)
    per_token = torch.where(mask, -weight * surrogate, 0.0)
    return per_token, per_token.sum() / mask.sum()


def ours(current, proximal, behaviour, advantages, mask, mode):
    weights = RolloutCorrection(mode, max_weight=CAP).weights(proximal, behaviour, mask)
    inputs = PolicyLossInput(current, proximal, behaviour, advantages, mask, correction=weights)
    per_token, _ = Clip(clip_range=EPSILON, clip_against="proximal")(inputs)
    per_token = torch.where(mask, per_token, 0.0)
    return per_token, per_token.sum() / mask.sum()


def matching_gradient(inputs: tuple[torch.Tensor, ...], mode: str, filter_above_cap: bool) -> torch.Tensor:
    """Our per-token loss and its gradient equal the reference's (float64, to 1e-15); the gradient."""
    current = inputs[0]
    want_tokens, want = reference_decoupled(*inputs, CAP, filter_above_cap)
    (want_gradient,) = torch.autograd.grad(want, current)
    got_tokens, got = ours(*inputs, mode)
    (got_gradient,) = torch.autograd.grad(got, current)
    torch.testing.assert_close(got_tokens, want_tokens, rtol=0, atol=1e-15)
    torch.testing.assert_close(got_gradient, want_gradient, rtol=0, atol=1e-15)
    return got_gradient


def test_the_issues_formula_is_clip_with_the_truncated_correction():
    inputs = tensors()
    _, proximal, behaviour, _, mask = inputs
    assert (torch.exp(proximal - behaviour)[mask] > CAP).any()  # the cap is reached
    matching_gradient(inputs, "token_truncate", filter_above_cap=False)


def test_areals_behav_imp_weight_cap_is_clip_with_the_masked_correction():
    inputs = tensors(seed=1)
    _, proximal, behaviour, _, mask = inputs
    over = (torch.exp(proximal - behaviour) > CAP) & mask
    assert over.any() and not over[mask].all()  # some tokens filtered, some kept
    gradient = matching_gradient(inputs, "token_mask", filter_above_cap=True)
    assert (gradient[over] == 0).all()  # a filtered token teaches nothing


def test_on_policy_samples_make_it_plain_ppo():
    """Fresh samples (mu = pi_prox): every weight is 1 and the objective is PPO-clip's, as in the synchronous loop."""
    current, proximal, _, advantages, mask = tensors(seed=2)
    got_tokens, _ = ours(current, proximal, proximal, advantages, mask, "token_truncate")
    plain, _ = Clip(clip_range=EPSILON).surrogate(current, proximal, advantages, mask)
    torch.testing.assert_close(got_tokens, torch.where(mask, plain, 0.0), rtol=0, atol=0)
