"""Multi-turn episodes: tools, environments and the batched episode rollout on the shared base."""

from rlhf_lightning.episodes.environment import Environment, Step, ToolEnvironment
from rlhf_lightning.episodes.tools import Tool

__all__ = ["Environment", "Step", "Tool", "ToolEnvironment"]
