"""Small environments written with OpenEnv's classes for the adapter's tests: an echo whose actions can misbehave on
purpose (sleep, exit, answer what does not validate), an MCP environment with one tool, and a typed client."""

from __future__ import annotations

import os
import time
from typing import Any

from fastmcp import FastMCP
from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    message: str


class PairAction(Action):
    """Two required fields: the policy's text fills one, so the other is missing (a configuration's fault)."""

    message: str
    volume: int


class EchoEnvironment(Environment[EchoAction, EchoObservation, State]):
    """Echoes each message with reward 0.5; ``done`` ends with reward 1; ``sleep`` never returns; ``exit`` ends the
    process (a server dying mid-episode); ``invalid`` answers with an observation that does not validate."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    closed = 0  # instances closed, in this process

    def __init__(self, greeting: str = "hello") -> None:
        super().__init__()
        self.greeting = greeting
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> EchoObservation:
        self._state = State(episode_id=episode_id)
        return EchoObservation(message=f"{self.greeting} {seed}")

    def step(self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any) -> EchoObservation:
        self._state.step_count += 1
        if action.message == "sleep":
            time.sleep(3600)
        if action.message == "exit":
            os._exit(3)
        if action.message == "invalid":
            return EchoObservation.model_construct(message=None, reward=None, done=False, metadata={})
        if action.message == "done":
            return EchoObservation(message="bye", reward=1.0, done=True)
        return EchoObservation(message=f"echo {action.message}", reward=0.5)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        EchoEnvironment.closed += 1


class SingleSessionEcho(EchoEnvironment):
    """The echo without ``SUPPORTS_CONCURRENT_SESSIONS``: one session at a time."""

    SUPPORTS_CONCURRENT_SESSIONS = False


class AdderEnvironment(MCPEnvironment):
    """One MCP tool, ``add``; a sum of 10 ends the episode with reward 1."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("adder")

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: the first number.
                b: the second number.
            """
            return a + b

        super().__init__(mcp)
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self._state = State(episode_id=episode_id)
        return Observation()

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=True)

    def _scored(self, observation: Observation) -> Observation:
        result = getattr(observation, "result", None)
        if getattr(result, "data", None) == 10:
            observation.done, observation.reward = True, 1.0
        return observation

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(super().step(action, timeout_s, **kwargs))

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(await super().step_async(action, timeout_s, **kwargs))

    @property
    def state(self) -> State:
        return self._state


class EchoClient(EnvClient[EchoAction, EchoObservation, State]):
    """A typed client, as OpenEnv environments ship them: its observations are validated as EchoObservation."""

    def _step_payload(self, action: EchoAction) -> dict[str, Any]:
        return action.model_dump()

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[EchoObservation]:
        observation = EchoObservation(**payload.get("observation", {}), reward=payload.get("reward"),
                                      done=payload.get("done", False))
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)
