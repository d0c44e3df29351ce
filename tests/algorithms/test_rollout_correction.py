"""Importance-sampling correction of the sampler's log-probs: TRL 1.16's four modes number by number, in the
log-probs' dtype (float32 at least), the sampler's own log-probs kept with the rollout, the mismatch logged, the loss
weighted by the correction, and bounds that leave no room refused with one line."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlhf_lightning import GRPO, AdapterReward
from rlhf_lightning.algorithms.policy_losses import Clip, LossOutput, PolicyLoss, PolicyLossInput
from rlhf_lightning.algorithms.rollout_correction import (
    RolloutCorrection,
    correction_weights,
    mismatch_statistics,
)
from rlhf_lightning.models.spec import BaseModelSpec
from tests.helpers.cli import grpo as grpo_arguments
from tests.helpers.cli import one_line
from tests.helpers.models import LORA, built
from tests.helpers.online import first_batch


def trl_is_ratio(old_per_token_logps, sampling_per_token_logps, completion_mask, mode, clip_min, clip_max):
    """TRL 1.16 GRPOTrainer._generate_and_score_completions, the vLLM importance-sampling ratio, as its lines read."""
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * completion_mask
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:  # noqa: SIM108 (TRL's lines as they read)
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    return ratio


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize(("clip_min", "clip_max"), [(None, 3.0), (0.5, 2.0), (0.8, None)])
def test_the_weights_are_trls_number_by_number(mode, clip_min, clip_max):
    torch.manual_seed(0)
    trainer = torch.randn(6, 5) - 2
    sampler = trainer + 0.6 * torch.randn(6, 5)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[2, 3:] = False
    ours = correction_weights(trainer, sampler, mask, mode, clip_min, clip_max)
    theirs = trl_is_ratio(trainer, sampler, mask.float(), mode, clip_min, clip_max).expand(6, 5)
    torch.testing.assert_close(ours[mask], theirs[mask])
    assert ours[~mask].eq(0).all()
    if mode.endswith("mask") and (clip_min, clip_max) == (0.5, 2.0):
        assert ours[mask].eq(0).any()  # these bounds leave some out
    assert correction_weights(trainer, sampler, mask, "none").eq(1).all()


@pytest.mark.parametrize("mode", ["token_mask", "sequence_truncate"])
def test_the_weights_follow_the_log_probs_dtype_float32_at_least(mode):
    torch.manual_seed(0)
    trainer = torch.randn(4, 5, dtype=torch.float64) - 2
    sampler = trainer + 0.3 * torch.randn(4, 5, dtype=torch.float64)
    mask = torch.ones(4, 5, dtype=torch.bool)
    ours = correction_weights(trainer, sampler, mask, mode, 0.5, 2.0)
    # float64 log-probs: TRL's lines in float64, to the last bit (in float32 they differ by ~5e-7 relative)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, trl_is_ratio(trainer, sampler, mask.double(), mode, 0.5, 2.0).expand(4, 5),
                               rtol=0, atol=0)
    assert mismatch_statistics(trainer, sampler, mask)["kl"].dtype == torch.float64
    for dtype in (torch.float32, torch.bfloat16):  # never below float32: exp of a bf16 difference keeps 3 digits
        assert correction_weights(trainer.to(dtype), sampler.to(dtype), mask, mode, 0.5, 2.0).dtype == torch.float32
        assert mismatch_statistics(trainer.to(dtype), sampler.to(dtype), mask)["kl"].dtype == torch.float32


def test_a_minimum_not_below_the_maximum_is_refused_with_both_values(capsys, tiny_model_dir, reward_dir):
    # Set on the command line against the default maximum: a mask over an empty range would drop every token.
    line = one_line(capsys, *grpo_arguments(tiny_model_dir, reward_dir,
                                            "--model.init_args.correction.mode=token_mask",
                                            "--model.init_args.correction.min_weight=5"))
    assert line == ("error: correction.min_weight=5.0 is not below correction.max_weight=3.0: the correction keeps "
                    "weights inside [min_weight, max_weight], so every token would be masked out or get the same "
                    "weight; set the minimum below the maximum (TRL's bounds: none and 3.0)")
    with pytest.raises(ValueError, match=r"^correction.min_weight=2.0 is not below correction.max_weight=2.0: "):
        GRPO(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), reward=AdapterReward(str(reward_dir)),
             correction={"mode": "token_truncate", "min_weight": 2.0, "max_weight": 2.0})


def test_the_mismatch_is_a_kl_and_trls_logprob_difference():
    trainer = torch.tensor([[-1.0, -2.0, -3.0]])
    sampler = torch.tensor([[-1.5, -2.0, -9.0]])
    mask = torch.tensor([[True, True, False]])
    stats = mismatch_statistics(trainer, sampler, mask)
    # KL(sampler || trainer) by k3 on the sampler's tokens: r = pi_t / pi_s, (r - 1) - log r
    r = math.exp(0.5)
    torch.testing.assert_close(stats["kl"], torch.tensor(((r - 1 - 0.5) + 0.0) / 2))
    torch.testing.assert_close(stats["logprob_diff_mean"], torch.tensor(0.25))
    torch.testing.assert_close(stats["logprob_diff_max"], torch.tensor(0.5))


def grpo(tiny_model_dir, reward_dir, **kwargs):
    return built(GRPO(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), policy_lora=LORA,
                      sampling={"max_new_tokens": 6}, samples_per_prompt=2, reward=AdapterReward(str(reward_dir)),
                      **kwargs))


def test_the_sampler_log_probs_are_kept_and_the_loss_is_weighted(tiny_model_dir, reward_dir):
    module = grpo(tiny_model_dir, reward_dir, correction=RolloutCorrection("token_truncate", max_weight=1.5))
    torch.manual_seed(0)
    experience, _ = module.collect_and_prepare(first_batch(module))
    mask = experience.response_mask
    # The sampler's own log-probs equal the trainer's pass in fp32 on CPU (same model, same temperature).
    trainer, _ = module.policy.response_logprobs("policy", experience.input_ids, experience.attention_mask, mask)
    torch.testing.assert_close(experience.sampler_logprobs[mask], trainer[mask], atol=1e-5, rtol=1e-5)
    assert experience.sampler_logprobs[~mask].eq(0).all()
    # A sampler that disagreed: the policy loss is the uncorrected per-token loss times the truncated weight.
    shifted = experience.sampler_logprobs + torch.where(mask, torch.linspace(-1, 1, mask.shape[1]), 0.0)
    corrected = dataclasses.replace(experience, sampler_logprobs=shifted)
    terms = module.losses(corrected)
    plain = grpo(tiny_model_dir, reward_dir)
    plain.model.load_state_dict(module.model.state_dict())
    uncorrected = plain.losses(corrected)
    assert uncorrected["rollout/mismatch_kl"] > 0 and "rollout/correction_weight" not in uncorrected
    weights = correction_weights(trainer, shifted, mask, "token_truncate", None, 1.5)
    logprobs = trainer.detach()
    per_token = -experience.advantages * torch.exp(logprobs - logprobs)  # ratio 1: the single-step surrogate
    expected = (per_token * weights)[mask].sum() / mask.sum()
    torch.testing.assert_close(terms["loss/policy"], expected)
    torch.testing.assert_close(terms["rollout/correction_weight"], weights[mask].mean())
    torch.testing.assert_close(uncorrected["loss/policy"], per_token[mask].sum() / mask.sum())


def test_clip_against_the_sampler_puts_the_samplers_log_probs_in_the_ratio(tiny_model_dir, reward_dir):
    """The loss's ``clip_against: sampler`` (naive PPO-clip against the behaviour policy, the ablation of
    asynchronous runs):
    the ratio is pi / mu, so the loss is Clip's of the trainer's log-probs against the sampler's, while the mismatch
    is still the trainer's log-probs at the update's start against the sampler's."""
    module = grpo(tiny_model_dir, reward_dir, policy_loss=Clip(clip_against="sampler"), update={"epochs": 2})
    torch.manual_seed(0)
    experience, _ = module.collect_and_prepare(first_batch(module))
    mask = experience.response_mask
    stale = experience.sampler_logprobs + torch.where(mask, torch.linspace(-0.6, 0.6, mask.shape[1]), 0.0)
    terms = module.losses(dataclasses.replace(experience, sampler_logprobs=stale))
    trainer, _ = module.policy.response_logprobs("policy", experience.input_ids, experience.attention_mask, mask)
    per_token, _ = Clip().surrogate(trainer.detach(), stale, experience.advantages, mask)
    torch.testing.assert_close(terms["loss/policy"], per_token[mask].sum() / mask.sum())
    assert terms["policy/clipfrac"] > 0  # ratios away from 1: the clip acts on them
    torch.testing.assert_close(terms["rollout/mismatch_kl"],
                               mismatch_statistics(experience.logprobs, stale, mask)["kl"])
    with pytest.raises(ValueError, match="^policy_loss.clip_against: sampler with correction.mode: token_truncate"):
        grpo(tiny_model_dir, reward_dir, policy_loss=Clip(clip_against="sampler"),
             correction={"mode": "token_truncate"})


class Recorded(PolicyLoss):
    """Clip's loss, keeping the input the loop gave it (a loss that reads the whole input defines ``__call__``)."""

    def __init__(self) -> None:
        self.seen: list[PolicyLossInput] = []

    def __call__(self, inputs: PolicyLossInput) -> LossOutput:
        self.seen.append(inputs)
        return Clip()(inputs)


def test_the_loss_receives_the_trainers_the_samplers_and_the_references_log_probs_and_the_weights(
        tiny_model_dir, reward_dir):
    """The one typed input holds what a decoupled or reference-anchored loss needs, each from its source."""
    loss = Recorded()
    module = grpo(tiny_model_dir, reward_dir, policy_loss=loss, kl={"coef": 0.1, "added_to": "loss"},
                  correction={"mode": "token_mask", "max_weight": 1.5})
    torch.manual_seed(0)
    experience, _ = module.collect_and_prepare(first_batch(module))
    mask = experience.response_mask
    stale = experience.sampler_logprobs + torch.where(mask, torch.linspace(-1, 1, mask.shape[1]), 0.0)
    terms = module.losses(dataclasses.replace(experience, sampler_logprobs=stale))
    (inputs,) = loss.seen
    trainer, _ = module.policy.response_logprobs("policy", experience.input_ids, experience.attention_mask, mask)
    torch.testing.assert_close(inputs.logprobs, trainer)
    assert inputs.logprobs.requires_grad and not inputs.proximal.requires_grad
    torch.testing.assert_close(inputs.proximal, trainer.detach())  # one step per rollout: its own pass
    assert inputs.behaviour is not None and torch.equal(inputs.behaviour, stale)
    assert inputs.reference is not None and torch.equal(inputs.reference, experience.ref_logprobs)
    assert torch.equal(inputs.advantages, experience.advantages) and torch.equal(inputs.mask, mask)
    weights = correction_weights(trainer, stale, mask, "token_mask", None, 1.5)
    torch.testing.assert_close(inputs.correction, weights)
    assert 0 < terms["rollout/corrected_out"] < 1  # some tokens masked out, some kept
