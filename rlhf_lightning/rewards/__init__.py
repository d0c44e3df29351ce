"""Rewards: the sources that score responses (``sources``: an adapter on the shared base, a separate model, Python
functions; LLM judges, ``judge``, with their templates ``judge_template``, parsers ``judge_parsers`` and judges in the
process ``judge_local`` or behind an endpoint ``judge_endpoint``; a process reward model, ``process_reward``; a reward
server, ``remote``, and what it and its client agree on, ``remote_protocol``), one JSON request with retries
(``http``), what the sources read (``inputs``), and how their scores combine (``combine``)."""

from rlhf_lightning.rewards.combine import RewardSet
from rlhf_lightning.rewards.inputs import RewardInputs, reward_inputs
from rlhf_lightning.rewards.judge import JudgeReward
from rlhf_lightning.rewards.process_reward import ProcessReward
from rlhf_lightning.rewards.remote import RemoteReward
from rlhf_lightning.rewards.sources import AdapterReward, FunctionReward, ModelReward, RewardSource

__all__ = ["AdapterReward", "FunctionReward", "JudgeReward", "ModelReward", "ProcessReward", "RemoteReward",
           "RewardInputs", "RewardSet", "RewardSource", "reward_inputs"]
