"""The stage modules are composed, not stacked: each is one chain of our classes, every class with at most one base
of ours (no mixins split off to meet a size limit), and the online modules' chains are at most :data:`MAX_ONLINE`
long; what used to be mixins and levels of the chain are components the module holds (``ranks``, ``held_out``, the
``collector`` of step 1 and the ``updater`` of step 4)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

import rlhf_lightning as r
from rlhf_lightning.core.collect import Collector
from rlhf_lightning.core.distributed import Ranks
from rlhf_lightning.core.held_out import HeldOutSamples
from rlhf_lightning.core.policy import Policy
from rlhf_lightning.core.stage import StageModule
from rlhf_lightning.core.update import PolicyUpdate

ONLINE = (r.PPO, r.GRPO, r.RLOO, r.REINFORCEPlusPlus, r.OnlineDPO, r.OnPolicyDistillation)
# PPO > PolicyGradient > OnlineRL > StageModule: itself, its family, the online base, the stage base (the policy,
# its sampler and log-probabilities, is a part the module holds).
MAX_ONLINE = 4


def ours(cls: type) -> list[type]:
    """The classes of this package in ``cls``'s method resolution order."""
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == "rlhf_lightning"]


def mixed_in(cls: type) -> list[str]:
    """Each class of ours in ``cls``'s MRO that has more than one base of ours, with those bases (none: a chain)."""
    return [f"{c.__name__}({', '.join(b.__name__ for b in bases)})" for c in ours(cls)
            if len(bases := [b for b in c.__bases__ if b.__module__.split(".")[0] == "rlhf_lightning"]) > 1]


def stage_modules() -> list[type]:
    found, todo = [], [StageModule]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [cls for cls in found if cls.__module__.startswith("rlhf_lightning.")]


def test_every_stage_module_is_one_chain_of_our_classes_and_the_chain_ends_at_lightning():
    shipped = {r.PPO, r.DPO, r.KTO, r.SFT, r.RewardModel, r.ProcessRewardModel, *ONLINE}  # imported (lazily) first
    modules = stage_modules()
    assert shipped <= set(modules)
    for module in modules:
        assert mixed_in(module) == [], module.__name__
        assert ours(module)[-1] is StageModule and StageModule.__bases__ == (L.LightningModule,)


def test_the_online_modules_hold_at_most_four_classes_of_ours():
    chains = {module.__name__: [c.__name__ for c in ours(module)] for module in ONLINE}
    assert chains["PPO"] == ["PPO", "PolicyGradient", "OnlineRL", "StageModule"]
    assert chains["OnlineDPO"] == ["OnlineDPO", "OnlineRL", "StageModule"]
    assert [c.__name__ for c in ours(r.DPO)] == ["DPO", "OfflinePreference", "StageModule"]
    assert max(len(chain) for chain in chains.values()) <= MAX_ONLINE, chains


def test_the_check_sees_a_mixin():
    mixin = type("Mixin", (), {"__module__": "rlhf_lightning.fake"})
    stacked = type("Stacked", (mixin, r.GRPO), {"__module__": "rlhf_lightning.fake"})
    assert mixed_in(stacked) == ["Stacked(Mixin, GRPO)"]
    assert len(ours(stacked)) == len(ours(r.GRPO)) + 2


@pytest.mark.parametrize("module", [r.PPO, r.DPO])
def test_what_were_mixins_are_components_the_module_holds(module, tiny_model_dir, reward_dir):
    from rlhf_lightning.models.spec import BaseModelSpec

    extra = {"reward": r.AdapterReward(path=str(reward_dir))} if module is r.PPO else {}
    built = module(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), **extra)
    value = torch.tensor([1.0, 2.0])
    assert isinstance(built.ranks, Ranks) and not built.ranks.distributed  # outside a fit: one process
    assert built.ranks.sum(value) is value and built.ranks.mean(value) is value and built.ranks.most(3) == 3
    assert isinstance(built.held_out, HeldOutSamples) and built.held_out.module is built
    assert isinstance(built.policy, Policy) and built.policy.stage is built  # the adapter, sampler, log-probs
    # the policy's arguments are the module's hyper-parameters, as they were when the module took them itself
    assert {"base", "policy_lora", "sampling", "logprob_chunk", "seed", "seed_scope", "sharded_rollout", "pass_at_k",
            "export_dir"} <= built.hparams.keys() and built.hparams["seed"] == 0
    assert not {"engine", "gold_reward"} & built.hparams.keys()  # objects and code, not settings
    # the evaluation's metrics are registered on the module, so that they move to its device with it
    assert built.val_metrics is built.held_out.metrics and "val_metrics.kl" in dict(built.named_modules())
    for gone in ("sum_over_ranks", "is_distributed", "evaluate_samples", "record_validation", "overlap", "sampler",
                 "rollouts", "generate", "response_logprobs", "engine"):
        assert not hasattr(built, gone), gone  # the mixins' members, now the components'
    if module is r.PPO:  # steps 1 and 4 of the online loop: parts the module holds, handed the module at each call
        assert isinstance(built.collector, Collector) and built.collector.rewards is built.rewards
        assert built.dense_step_rewards is True and built.collector.samples_per_prompt == 1  # read by the collector
        assert isinstance(built.updater, PolicyUpdate) and built.updater.settings is built.update_settings
        assert built.updater.settings.epochs == 4  # PPO's default update
