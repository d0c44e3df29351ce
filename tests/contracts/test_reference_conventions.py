"""Where a docstring names a reference implementation, the numbers are that implementation's: TRL 1.16's RLOO
(per-response ratio of the summed log-ratio, ``normalize_advantages``), OpenRLHF 0.11's advantage whitening and
KL clamp, and TRL's ``masked_whiten`` for PPO. Each reference formula is written out here as the reference
computes it, on inputs where the conventions differ, and compared number by number."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning import RLOO
from rlhf_lightning.algorithms.group import normalize_advantages, rloo_advantages
from rlhf_lightning.algorithms.kl import kl_penalty
from rlhf_lightning.algorithms.masked import masked_whiten
from rlhf_lightning.algorithms.policy_losses import Clip
from rlhf_lightning.algorithms.surrogate import aggregate_loss, clipped_surrogate, loss_normaliser
from tests.helpers.online import make_online, perturb, prompt_batch


def random_tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(6, 9, generator=generator) * 3
    old_logprobs = logprobs + torch.randn(6, 9, generator=generator) * 0.08
    advantages = torch.randn(6, generator=generator)
    lengths = torch.tensor([9, 7, 3, 1, 5, 8])
    mask = torch.arange(9)[None, :] < lengths[:, None]
    return logprobs, old_logprobs, advantages, mask


def test_sequence_sum_ratio_with_sequence_mean_is_trl_rloo_loss():
    """TRL 1.16 ``RLOOTrainer._compute_loss``: logps summed over the completion, one ratio per response, clipped,
    ``-min(...)``, mean over responses."""
    logprobs, old_logprobs, advantages, mask = random_tokens()
    logprobs.requires_grad_()
    # TRL's lines, written out
    trl_logps = (logprobs * mask).sum(1)
    trl_old = (old_logprobs * mask).sum(1)
    coef_1 = torch.exp(trl_logps - trl_old)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
    trl_loss = -torch.min(coef_1 * advantages, coef_2 * advantages).mean()
    # ours
    surrogate = clipped_surrogate(logprobs, old_logprobs, advantages[:, None].expand_as(mask), mask, 0.2, 0.28,
                                  "sequence_sum")
    ours = aggregate_loss(surrogate.loss, mask, "sequence_mean", loss_normaliser(mask, "sequence_mean"))
    torch.testing.assert_close(ours, trl_loss, rtol=1e-6, atol=1e-7)
    (trl_gradient,) = torch.autograd.grad(trl_loss, logprobs, retain_graph=True)
    (our_gradient,) = torch.autograd.grad(ours, logprobs)
    torch.testing.assert_close(our_gradient, trl_gradient, rtol=1e-5, atol=1e-7)
    # the ratio differs from GSPO's geometric mean wherever a response moved and has more than one token
    gspo = clipped_surrogate(logprobs, old_logprobs, advantages[:, None].expand_as(mask), mask, 0.2, 0.28,
                             "sequence")
    assert not torch.allclose(gspo.ratio[mask], surrogate.ratio[mask])
    torch.testing.assert_close(surrogate.ratio[:, 0], coef_1.detach())


def test_normalize_advantages_is_trl_rloo_with_std_plus_1e_4():
    """TRL: ``(advantages - nanmean) / (nanstd + 1e-4)``, nanstd with Bessel's correction."""
    advantages = rloo_advantages(torch.tensor([0.0, 1.0, 1.0, 2.0, 0.5, 0.5, 3.0, -1.0]), 4)
    mean = advantages.mean()
    std = ((advantages - mean) ** 2).sum().div(advantages.numel() - 1).sqrt()
    torch.testing.assert_close(normalize_advantages(advantages), (advantages - mean) / (std + 1e-4))
    # a batch of equal advantages stays finite: (0) / (0 + 1e-4) = 0, where sqrt(var + 1e-8) would differ
    torch.testing.assert_close(normalize_advantages(torch.full((4,), 2.0)), torch.zeros(4))
    small = torch.tensor([1e-5, -1e-5, 2e-5, 0.0])
    trl = (small - small.mean()) / (small.std() + 1e-4)
    torch.testing.assert_close(normalize_advantages(small), trl)
    assert not torch.allclose(masked_whiten(small, torch.ones(4, dtype=torch.bool)), trl)  # the old convention


def test_openrlhf_whitening_is_biased_variance_floored_at_1e_8():
    """OpenRLHF 0.11 ``experience_maker``: mean and variance over every valid token, ``var.clamp(min=1e-8)
    .rsqrt()``."""
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(4, 6, generator=generator)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 2, 4, 1])[:, None]
    count = mask.sum()
    mean = (values * mask).sum() / count
    variance = ((values - mean).pow(2) * mask).sum() / count
    openrlhf = (values - mean) * variance.clamp(min=1e-8).rsqrt()
    ours = masked_whiten(values, mask, unbiased=False, floor=True)
    torch.testing.assert_close(ours, torch.where(mask, openrlhf, 0.0))
    # TRL's convention (the default, PPO's) differs by Bessel's factor
    trl = masked_whiten(values, mask)
    bessel = ((values - mean).pow(2) * mask).sum() / (count - 1)
    torch.testing.assert_close(trl, torch.where(mask, (values - mean) * torch.rsqrt(bessel + 1e-8), 0.0))
    # where all values are equal the floor keeps the scale at 1e4, as OpenRLHF's does
    flat = torch.full((2, 3), 0.5)
    flat[0, 0] = 0.5 + 1e-6
    floor = masked_whiten(flat, torch.ones(2, 3, dtype=torch.bool), unbiased=False, floor=True)
    torch.testing.assert_close(floor, (flat - flat.mean()) * 1e4)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_clamp_is_openrlhf_compute_approx_kl(estimator):
    """OpenRLHF 0.11 ``compute_approx_kl``: the estimator of ``log_ratio = log_probs - log_probs_base``, then
    ``.clamp(min=-10, max=10)``."""
    log_probs = torch.tensor([-0.5, -3.0, -20.0, -0.1, -15.0])
    base = torch.tensor([-0.6, -1.0, -2.0, -16.0, -0.5])
    log_ratio = log_probs - base
    reference = {"k1": log_ratio, "k2": log_ratio**2 / 2.0, "k3": (-log_ratio).exp() - 1 + log_ratio}[estimator]
    reference = reference.clamp(min=-10, max=10)
    torch.testing.assert_close(kl_penalty(log_probs, base, estimator, clamp=10.0), reference)
    unclamped = kl_penalty(log_probs, base, estimator)
    assert (unclamped.abs() > 10).any()  # these inputs are where the two conventions part


def test_rloo_with_trl_settings_computes_trl_loss_on_a_rollout(tiny_model_dir, reward_dir):
    """The RLOO module with ``policy_loss.ratio_level: sequence_sum`` and ``loss.aggregation: sequence_mean``,
    off-policy (a policy moved since sampling): its loss is TRL's formula on the module's own log-probs and
    advantages."""
    module = make_online(RLOO, tiny_model_dir, reward_dir, policy_loss=Clip(clip_range=0.2, ratio_level="sequence_sum"),
                  loss={"aggregation": "sequence_mean"}, kl={"coef": 0.0}, update={"epochs": 2})
    experience, _ = module.collect_and_prepare(prompt_batch(module))
    perturb(module, "policy")  # the update's policy is not the sampler's: ratios away from 1
    terms = module.losses(experience)
    logprobs, _ = module.policy.response_logprobs("policy", experience.input_ids, experience.attention_mask,
                                           experience.response_mask)
    mask = experience.response_mask
    coef_1 = torch.exp((logprobs * mask).sum(1) - (experience.logprobs * mask).sum(1))
    advantages = experience.advantages[:, 0]
    trl = -torch.min(coef_1 * advantages, torch.clamp(coef_1, 0.8, 1.2) * advantages).mean()
    torch.testing.assert_close(terms["loss/policy"], trl, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(coef_1, torch.ones_like(coef_1))


def test_clip_range_high_below_clip_range_is_refused():
    with pytest.raises(ValueError, match=r"^policy_loss: clip_range_high=0.1 is below clip_range=0.2: the upper"):
        Clip(clip_range=0.2, clip_range_high=0.1)
