"""Environments: what answers the policy between its turns.

An :class:`Environment` is made anew for every episode (the config names a class and its arguments, and the
module calls it once per episode), so no state leaks between episodes or ranks. It has the two methods users know
from gym-style APIs, with chat messages as observations::

    reset(row) -> messages                       # the episode's opening messages, from the dataset row
    step(messages) -> Step(messages, reward, done)  # after each assistant turn: what the policy reads next
    close()                                      # once the episode has ended, however it ended
    close_shared()                               # once the fit has ended: what every episode shared (a server)

:class:`ToolEnvironment` runs the tool calls of each assistant turn and ends the episode at the first turn without
one; subclass it (or :class:`Environment`) for feedback, games or graders.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_lightning.environments.tools import Tool, ToolResult, make_tools

Message = dict[str, Any]


@dataclass
class Step:
    """What the environment answers an assistant turn with.

    Args:
        messages: appended to the conversation (``tool`` results, ``user`` feedback); empty when ``done``.
        reward: this turn's reward (0 for none); the episode's other rewards come from the reward sources.
        done: the episode ends here.
        counts: event counts for the metrics (``tool_calls/<name>``, ``tool_errors``, ``invalid_tool_calls``).
    """

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    counts: Counter = field(default_factory=Counter)


class Environment:
    """One episode's world. Override :meth:`step` (and :meth:`reset` when the opening is not the row's prompt).

    ``tools`` (name -> :class:`~rlhf_lightning.environments.tools.Tool`) are shown to the model through the chat
    template's ``tools=``; an environment without tools shows none.
    """

    tools: dict[str, Tool] = {}

    def reset(self, row: dict[str, Any]) -> list[Message]:
        """The opening messages: the row's ``prompt`` (a string becomes one user message)."""
        prompt = row["prompt"]
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]

    def step(self, messages: list[Message]) -> Step:
        """Answer the last message, the policy's turn: ``{"role": "assistant", "content": ..., "tool_calls":
        [...], "invalid_tool_calls": [error texts]}`` (calls as parsed from the generated text)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode held (a session, a process): called once the episode has ended, however it
        ended (done, out of turns or tokens, or the rollout stopped by an error). Nothing here."""

    def close_shared(self) -> None:
        """Release what every episode of this environment's configuration shares (a server the fit started):
        called once the fit ends (its teardown), on an environment the fit made. Nothing here."""


class ToolEnvironment(Environment):
    """Runs the calls of each assistant turn and returns their results as ``tool`` messages; the episode ends at
    the first turn that calls nothing. A tool that raises or times out, an unknown tool and a malformed call all
    answer with an error text (and are counted), never stop the run.

    Args:
        tools: the tools' import paths (``package.module.function``) or the functions.
        timeout: seconds a tool call may run.
    """

    def __init__(self, tools: Sequence[str | Callable[..., Any]] = (), timeout: float = 10.0) -> None:
        self.tools = make_tools(tools, timeout)

    def step(self, messages: list[Message]) -> Step:
        turn = messages[-1]
        calls, invalid = turn.get("tool_calls", []), turn.get("invalid_tool_calls", [])
        if not calls and not invalid:
            return Step(done=True)
        step = Step()
        for error in invalid:
            step.counts["invalid_tool_calls"] += 1
            step.messages.append({"role": "tool", "name": "error", "content": f"error: {error}"})
        for call in calls:
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            tool = self.tools.get(name)
            result = (ToolResult(f"error: no tool named {name!r}; the tools are {', '.join(self.tools) or 'none'}",
                                 "unknown") if tool is None else tool(arguments))
            step.counts["tool_calls"] += 1
            step.counts[f"tool_calls/{name if tool is not None else 'unknown'}"] += 1
            if result.status != "ok":
                step.counts["tool_errors"] += 1
                step.counts[f"tool_{result.status}"] += 1
            step.messages.append({"role": "tool", "name": name, "content": result.text})
        return step


def not_an_environment(given: str) -> str:
    """Why ``given`` (a class's import path or name), which is not an :class:`Environment`, cannot be one, and what
    it must be: the line for a gym-style class named in a config."""
    name = given.rpartition(".")[2]
    return (f"{given} is not an rlhf_lightning Environment: an environment must subclass "
            "rlhf_lightning.environments.Environment (an episode calls reset(row) -> opening messages and "
            "step(messages) -> Step(messages, reward, done)); a gym-style class keeps its reset and step and adds "
            f"the base: class {name}(Environment)")


def checked_step(environment: Environment, messages: list[Message], row: int, turn: int) -> Step:
    """``environment.step(messages)``, or one line naming the environment, the episode's row and the turn when
    it raises or answers with something other than a finite reward and a list of messages."""
    where = f"environment {type(environment).__qualname__}, row {row}, turn {turn}"
    try:
        step = environment.step(messages)
    except Exception as error:
        raise RuntimeError(f"{where}: step raised {type(error).__name__}: {error}") from error
    if isinstance(step, tuple) and len(step) == 3:  # the (messages, reward, done) tuple of gym-style code
        step = Step(list(step[0]), step[1], step[2])
    if not isinstance(step, Step):
        raise TypeError(f"{where}: step must return a Step or (messages, reward, done), got {type(step).__name__}")
    if not isinstance(step.reward, int | float) or not math.isfinite(step.reward):
        raise ValueError(f"{where}: step returned the reward {step.reward!r}; expected a finite number")
    if not isinstance(step.messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                      for m in step.messages):
        raise TypeError(f"{where}: step must return a list of messages with 'role' and 'content', got "
                        f"{step.messages!r}")
    return step


def checked_reset(environment: Environment, row_values: dict[str, Any], row: int) -> list[Message]:
    """``environment.reset(row_values)`` with the same one-line errors as :func:`checked_step`."""
    where = f"environment {type(environment).__qualname__}, row {row}"
    try:
        messages = environment.reset(row_values)
    except Exception as error:
        raise RuntimeError(f"{where}: reset raised {type(error).__name__}: {error}") from error
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise TypeError(f"{where}: reset must return a non-empty list of messages, got {messages!r}")
    return messages
