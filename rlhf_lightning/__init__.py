"""rlhf_lightning: RLHF on PyTorch Lightning with one frozen base model shared by every role."""

from rlhf_lightning.data.modules import (
    PreferenceDataModule,
    PromptDataModule,
    SFTDataModule,
    StepwiseDataModule,
    UnpairedPreferenceDataModule,
)
from rlhf_lightning.distill import OnPolicyDistillation
from rlhf_lightning.dpo import DPO
from rlhf_lightning.grpo import GRPO
from rlhf_lightning.kto import KTO
from rlhf_lightning.online_dpo import OnlineDPO
from rlhf_lightning.ppo import PPO
from rlhf_lightning.prm import ProcessRewardModel
from rlhf_lightning.reinforce_pp import REINFORCEPlusPlus
from rlhf_lightning.reward_model import RewardModel
from rlhf_lightning.rewards.judge import JudgeReward
from rlhf_lightning.rewards.process import ProcessReward
from rlhf_lightning.rewards.remote import RemoteReward
from rlhf_lightning.rewards.sources import AdapterReward, FunctionReward, ModelReward, RewardSource
from rlhf_lightning.rloo import RLOO
from rlhf_lightning.sft import SFT

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
    "FunctionReward",
    "JudgeReward",
    "ModelReward",
    "PreferenceDataModule",
    "ProcessReward",
    "ProcessRewardModel",
    "PromptDataModule",
    "REINFORCEPlusPlus",
    "RemoteReward",
    "RewardModel",
    "RewardSource",
    "SFTDataModule",
    "StepwiseDataModule",
    "UnpairedPreferenceDataModule",
]
__version__ = "0.1.0"
