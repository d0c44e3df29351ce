"""The policy-gradient loop every on-policy stage shares (``rlhf_lightning.core.policy_gradient``)."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning import GRPO, PPO, RLOO, REINFORCEPlusPlus
from rlhf_lightning.algorithms import kl_penalty, token_rewards
from rlhf_lightning.algorithms.group import group_advantages, returns_to_go, rloo_advantages
from rlhf_lightning.core.experience import sequence_kl
from rlhf_lightning.models.shared_base import adapter_of
from tests.helpers.online import assert_one_copy_of_the_base, make_online, perturb, prompt_batch

CRITIC_FREE = [GRPO, RLOO, REINFORCEPlusPlus]


@pytest.mark.parametrize("cls", CRITIC_FREE, ids=lambda cls: cls.__name__)
def test_rollout_advantages_are_the_pure_functions_on_the_experience(cls, tiny_model_dir, reward_dir):
    module = make_online(cls, tiny_model_dir, reward_dir, kl={"coef": 0.1, "added_to": "reward"})
    perturb(module, "policy")  # a policy away from the reference, so the KL terms are not zero
    experience, stats = module.collect_and_prepare(prompt_batch(module))
    assert experience.group_size == 4 and experience.response_mask.shape[0] == 16
    assert torch.equal(experience.input_ids[0, :experience.prompt_length],
                       experience.input_ids[3, :experience.prompt_length])  # a group shares its prompt
    mask = experience.response_mask
    kl = sequence_kl(experience.logprobs, experience.ref_logprobs, mask)
    if cls is GRPO:  # its kl.estimator (k3) summed over each response
        k3 = kl_penalty(experience.logprobs, experience.ref_logprobs, "k3").where(mask, 0.0).sum(-1)
        expected = group_advantages(experience.scores - 0.1 * k3, 4, "group", 1e-4)[:, None].expand_as(mask)
    elif cls is RLOO:
        expected = rloo_advantages(experience.scores - 0.1 * kl, 4)[:, None].expand_as(mask)
    else:
        rewards = token_rewards(experience.scores, kl_penalty(experience.logprobs, experience.ref_logprobs), mask,
                                0.1)
        returns = returns_to_go(rewards, mask)
        # OpenRLHF 0.11's normalisation, written out: biased variance over the valid tokens, floored at 1e-8
        mean = (returns * mask).sum() / mask.sum()
        variance = ((returns - mean).pow(2) * mask).sum() / mask.sum()
        expected = (returns - mean) * variance.clamp(min=1e-8).rsqrt()
    torch.testing.assert_close(experience.advantages, torch.where(mask, expected, 0.0))
    assert stats["objective/kl"] > 0 and type(experience).__name__ == "Experience"  # no values or returns


@pytest.mark.parametrize("cls", [*CRITIC_FREE, PPO], ids=lambda cls: cls.__name__)
def test_gradients_reach_exactly_the_policy_adapter(cls, tiny_model_dir, reward_dir):
    kwargs = {} if cls is PPO else {"kl": {"coef": 0.1}}
    module = make_online(cls, tiny_model_dir, reward_dir, loss={"ent_coef": 0.01}, **kwargs)
    perturb(module, "policy", "critic")
    experience, _ = module.collect_and_prepare(prompt_batch(module))
    terms = module.losses(experience)
    trainable = {name: p for name, p in module.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(terms["loss/policy"], list(trainable.values()), allow_unused=True)
    reached = {n for (n, _), g in zip(trainable.items(), grads, strict=True) if g is not None and g.abs().sum() > 0}
    policy = {n for n in trainable if adapter_of(n) == "policy"}
    assert reached == policy
    expected_trainable = policy | ({n for n in trainable if adapter_of(n) == "critic" or ".heads.critic" in n}
                                   if cls is PPO else set())
    assert set(trainable) == expected_trainable  # the reward adapter and head, and the base, are frozen


@pytest.mark.parametrize("cls", [PPO, *CRITIC_FREE], ids=lambda cls: cls.__name__)
def test_every_module_holds_one_copy_of_the_base(cls, tiny_model_dir, reward_dir):
    assert_one_copy_of_the_base(make_online(cls, tiny_model_dir, reward_dir), tiny_model_dir)
