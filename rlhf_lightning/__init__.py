"""rlhf_lightning: RLHF on PyTorch Lightning with one frozen base model shared by every role."""

from rlhf_lightning.algorithms.kl import KLPenalty
from rlhf_lightning.data.modules import (
    PreferenceDataModule,
    PromptDataModule,
    SFTDataModule,
    StepwiseDataModule,
    UnpairedPreferenceDataModule,
)
from rlhf_lightning.rewards.ensemble import EnsembleReward
from rlhf_lightning.rewards.judge import JudgeReward
from rlhf_lightning.rewards.process_reward import ProcessReward
from rlhf_lightning.rewards.remote import RemoteReward
from rlhf_lightning.rewards.sources import AdapterReward, FunctionReward, ModelReward, RewardSource
from rlhf_lightning.rollout.settings import Sampling
from rlhf_lightning.stages.distill import OnPolicyDistillation
from rlhf_lightning.stages.dpo import DPO
from rlhf_lightning.stages.grpo import GRPO
from rlhf_lightning.stages.kto import KTO
from rlhf_lightning.stages.online_dpo import OnlineDPO
from rlhf_lightning.stages.ppo import PPO
from rlhf_lightning.stages.process_reward_model import ProcessRewardModel
from rlhf_lightning.stages.reinforce_pp import REINFORCEPlusPlus
from rlhf_lightning.stages.reward_model import RewardModel
from rlhf_lightning.stages.rloo import RLOO
from rlhf_lightning.stages.sft import SFT
from rlhf_lightning.utils.moved_modules import install_old_names
from rlhf_lightning.utils.optim import OptimizerSettings

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
    "EnsembleReward",
    "FunctionReward",
    "JudgeReward",
    "KLPenalty",
    "ModelReward",
    "OptimizerSettings",
    "PreferenceDataModule",
    "ProcessReward",
    "ProcessRewardModel",
    "PromptDataModule",
    "REINFORCEPlusPlus",
    "RemoteReward",
    "RewardModel",
    "RewardSource",
    "Sampling",
    "SFTDataModule",
    "StepwiseDataModule",
    "UnpairedPreferenceDataModule",
]
__version__ = "0.1.0"

# A config, a checkpoint or a user's module may name a module by its path before it moved (one release).
install_old_names()
