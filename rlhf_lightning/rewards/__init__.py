"""Rewards: the sources that score responses -- an adapter on the shared base, a separate model or Python functions
(``sources``), an ensemble of reward adapters (``ensemble``), LLM judges (``judge``: its template ``judge_template``, its parsers ``judge_parsers``, a judge in
this process ``judge_local`` or behind an endpoint ``judge_endpoint``), a process reward model (``process_reward``),
reasoning-gym tasks' own checkers (``reasoning_gym_reward``) and a reward server (``remote``, with ``remote_protocol``,
what it and the server agree on) -- what they read (``inputs``), one JSON request with retries (``http``) and how
their scores combine (``combine``)."""

from rlhf_lightning.rewards.combine import RewardSet
from rlhf_lightning.rewards.ensemble import EnsembleReward
from rlhf_lightning.rewards.inputs import RewardInputs, reward_inputs
from rlhf_lightning.rewards.judge import JudgeReward
from rlhf_lightning.rewards.process_reward import ProcessReward
from rlhf_lightning.rewards.remote import RemoteReward
from rlhf_lightning.rewards.sources import AdapterReward, FunctionReward, ModelReward, RewardSource

__all__ = ["AdapterReward", "EnsembleReward", "FunctionReward", "JudgeReward", "ModelReward", "ProcessReward", "RemoteReward",
           "RewardInputs", "RewardSet", "RewardSource", "reward_inputs"]
