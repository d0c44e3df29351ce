"""rlhf_lightning: RLHF on PyTorch Lightning with one frozen base model shared by every role.

The public names are imported when first used (``rlhf_lightning.PPO``, ``from rlhf_lightning import GRPO``), not
with the package: what needs none of them (``python -m rlhf_lightning plot``, a config file that is not YAML, the
W&B reader) starts without importing torch, Lightning and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlhf_lightning.utils.compatibility import install_old_names

# Each public name -> the module that defines it.
_PUBLIC = {
    "KLPenalty": "rlhf_lightning.algorithms.kl",
    "LossSettings": "rlhf_lightning.algorithms.loss_settings",
    "Asynchronous": "rlhf_lightning.rollout.ahead",
    "Episodes": "rlhf_lightning.rollout.settings",
    "RolloutCorrection": "rlhf_lightning.algorithms.rollout_correction",
    "RewardShaping": "rlhf_lightning.rewards.combine",
    "UpdateSettings": "rlhf_lightning.core.micro_batches",
    "PreferenceDataModule": "rlhf_lightning.data.modules",
    "PromptDataModule": "rlhf_lightning.data.modules",
    "SFTDataModule": "rlhf_lightning.data.modules",
    "StepwiseDataModule": "rlhf_lightning.data.modules",
    "UnpairedPreferenceDataModule": "rlhf_lightning.data.modules",
    "EnsembleReward": "rlhf_lightning.rewards.ensemble",
    "JudgeReward": "rlhf_lightning.rewards.judge",
    "ProcessReward": "rlhf_lightning.rewards.process_reward",
    "RemoteReward": "rlhf_lightning.rewards.remote",
    "AdapterReward": "rlhf_lightning.rewards.sources",
    "FunctionReward": "rlhf_lightning.rewards.sources",
    "ModelReward": "rlhf_lightning.rewards.sources",
    "RewardSource": "rlhf_lightning.rewards.sources",
    "Sampling": "rlhf_lightning.rollout.settings",
    "OnPolicyDistillation": "rlhf_lightning.stages.distill",
    "DPO": "rlhf_lightning.stages.dpo",
    "GRPO": "rlhf_lightning.stages.grpo",
    "KTO": "rlhf_lightning.stages.kto",
    "OnlineDPO": "rlhf_lightning.stages.online_dpo",
    "PPO": "rlhf_lightning.stages.ppo",
    "Critic": "rlhf_lightning.stages.ppo",
    "ProcessRewardModel": "rlhf_lightning.stages.process_reward_model",
    "REINFORCEPlusPlus": "rlhf_lightning.stages.reinforce_pp",
    "RewardModel": "rlhf_lightning.stages.reward_model",
    "RLOO": "rlhf_lightning.stages.rloo",
    "SFT": "rlhf_lightning.stages.sft",
    "OptimizerSettings": "rlhf_lightning.utils.optim",
}

__all__ = [
    "DPO",
    "GRPO",
    "KTO",
    "OnPolicyDistillation",
    "OnlineDPO",
    "PPO",
    "RLOO",
    "SFT",
    "AdapterReward",
    "Asynchronous",
    "Critic",
    "EnsembleReward",
    "Episodes",
    "FunctionReward",
    "JudgeReward",
    "KLPenalty",
    "LossSettings",
    "ModelReward",
    "OptimizerSettings",
    "PreferenceDataModule",
    "ProcessReward",
    "ProcessRewardModel",
    "PromptDataModule",
    "REINFORCEPlusPlus",
    "RemoteReward",
    "RewardModel",
    "RewardShaping",
    "RewardSource",
    "RolloutCorrection",
    "Sampling",
    "SFTDataModule",
    "StepwiseDataModule",
    "UnpairedPreferenceDataModule",
    "UpdateSettings",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'rlhf_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# A config, a checkpoint or a user's module may name a module by its path before it moved (until
# utils.compatibility.REMOVED_IN): Python asks only sys.meta_path's finders for a submodule, so the finder goes on
# with the package (the module's docstring says more).
install_old_names()
