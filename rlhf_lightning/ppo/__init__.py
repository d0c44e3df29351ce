"""PPO: the LightningModule, its rollout structure and the reward sources."""

from rlhf_lightning.ppo.module import PPO
from rlhf_lightning.ppo.rewards import AdapterReward, FunctionReward, ModelReward, RewardSource

__all__ = ["PPO", "AdapterReward", "FunctionReward", "ModelReward", "RewardSource"]
