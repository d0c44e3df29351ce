"""rlhf_lightning: RLHF on PyTorch Lightning with one frozen base model shared by every role."""

from rlhf_lightning.data.modules import PreferenceDataModule, PromptDataModule, SFTDataModule
from rlhf_lightning.ppo import PPO, AdapterReward, FunctionReward, ModelReward, RewardSource
from rlhf_lightning.reward_model import RewardModel
from rlhf_lightning.sft import SFT

__all__ = [
    "PPO",
    "SFT",
    "AdapterReward",
    "FunctionReward",
    "ModelReward",
    "PreferenceDataModule",
    "PromptDataModule",
    "RewardModel",
    "RewardSource",
    "SFTDataModule",
]
__version__ = "0.1.0"
