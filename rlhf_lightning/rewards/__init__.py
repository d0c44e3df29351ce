"""Rewards: the sources that score responses (an adapter on the shared base, a separate model, Python functions, LLM
judges, a process reward model, a reward server), what they read, and how their scores combine."""

from rlhf_lightning.rewards.combine import RewardSet
from rlhf_lightning.rewards.inputs import RewardInputs, reward_inputs
from rlhf_lightning.rewards.judge import JudgeReward
from rlhf_lightning.rewards.process_reward import ProcessReward
from rlhf_lightning.rewards.remote import RemoteReward
from rlhf_lightning.rewards.sources import AdapterReward, FunctionReward, ModelReward, RewardSource

__all__ = ["AdapterReward", "FunctionReward", "JudgeReward", "ModelReward", "ProcessReward", "RemoteReward",
           "RewardInputs", "RewardSet", "RewardSource", "reward_inputs"]
