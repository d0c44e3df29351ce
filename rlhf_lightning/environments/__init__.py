"""What answers the policy between the turns of an episode: environments with ``reset``/``step``/``close``
(``environment``), tools as typed Python functions (``tools``) and the tool-call formats of chat templates
(``tool_calls``); OpenEnv environments as episodes (``openenv``: the adapter; ``openenv_sessions``: one session
per episode, in the process or on a server; ``openenv_server``: a server for an environment class, started by the
user or the fit; ``openenv_support``: the optional package, observations, actions and seeds) and its example game
(``guess_number``). The turn loop that runs them is :class:`rlhf_lightning.rollout.rollouts.Rollouts`."""

from rlhf_lightning.environments.environment import Environment, Step, ToolEnvironment
from rlhf_lightning.environments.openenv import OpenEnvEnvironment
from rlhf_lightning.environments.tools import Tool

__all__ = ["Environment", "OpenEnvEnvironment", "Step", "Tool", "ToolEnvironment"]
