"""Where a per-token reward added in ``shape_rewards`` (``rewards.with_dense``, the guides' length-penalty example)
reaches the update: the advantages of PPO, GRPO, RLOO and REINFORCE++ (both baselines) and online DPO's choice of
the chosen response move with it; on-policy distillation weighs it by ``reward_coef``, so at its default 0 it changes
nothing (docs/ppo.md says so)."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning import GRPO, PPO, RLOO, OnlineDPO, REINFORCEPlusPlus
from rlhf_lightning.algorithms.advantage_estimators import WhitenedReturns
from tests.helpers.micro_batches import make_stopping
from tests.helpers.online import first_batch, prompt_batch, student

COST = 0.5  # per response token: large against the synthetic task's score differences


def prepared(module, prompts, cost: float):
    """Steps 1 to 3 on ``prompts`` (drawn with seed 0), with ``cost`` charged per response token in step 2."""
    torch.manual_seed(0)
    experience, _ = module.collect_experience(prompts)
    experience, _ = module.collector.early_first_pass(module, experience)
    with torch.no_grad():
        rewards, _ = module.shape_rewards(experience)
        if cost:
            rewards = rewards.with_dense(-cost * experience.response_mask.float())
        return module.prepare_update(experience, rewards)


@pytest.mark.parametrize("cls, options", [
    (PPO, {}), (GRPO, {}), (RLOO, {}), (REINFORCEPlusPlus, {}), (REINFORCEPlusPlus, {"advantages": WhitenedReturns(baseline="group")}),
], ids=["PPO", "GRPO", "RLOO", "REINFORCE++", "REINFORCE++-baseline"])
def test_a_per_token_cost_moves_the_advantages(cls, options, stopping_model_dir):
    module = make_stopping(cls, stopping_model_dir, **options)
    prompts = prompt_batch(module)
    plain, _ = prepared(module, prompts, 0.0)
    charged, _ = prepared(module, prompts, COST)
    assert torch.equal(plain.input_ids, charged.input_ids)  # the same responses
    assert not torch.allclose(plain.advantages, charged.advantages)


def test_a_per_token_cost_changes_online_dpos_ranking(stopping_model_dir):
    module = make_stopping(OnlineDPO, stopping_model_dir)
    prompts = prompt_batch(module, n=8)
    _, plain = prepared(module, prompts, 0.0)
    _, charged = prepared(module, prompts, COST)
    assert float(plain["objective/scores_margin"]) != pytest.approx(float(charged["objective/scores_margin"]))


@pytest.mark.parametrize("reward_coef, moves", [(0.0, False), (1.0, True)])
def test_distillation_weighs_the_cost_by_reward_coef(reward_coef, moves, tiny_model_dir, reward_dir):
    module = student(tiny_model_dir, reward_dir, teacher=tiny_model_dir, reward_coef=reward_coef)
    prompts = first_batch(module)
    plain, _ = prepared(module, prompts, 0.0)
    charged, _ = prepared(module, prompts, COST)
    assert torch.equal(plain.advantages, charged.advantages) is not moves
