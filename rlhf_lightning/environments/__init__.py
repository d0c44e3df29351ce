"""What answers the policy between the turns of an episode: environments (``reset``/``step``; ``environment``), tools
(typed Python functions; ``tools``) and the tool-call formats of chat templates (``tool_calls``). The turn loop that
runs them is :class:`rlhf_lightning.rollout.rollouts.Rollouts`."""

from rlhf_lightning.environments.environment import Environment, Step, ToolEnvironment
from rlhf_lightning.environments.tools import Tool

__all__ = ["Environment", "Step", "Tool", "ToolEnvironment"]
