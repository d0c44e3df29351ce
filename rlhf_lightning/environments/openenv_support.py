"""What the OpenEnv adapter (``openenv``) needs besides the episode: the optional package's one-line absence, its
classes found by import path, an environment's action and observation classes, observations as chat messages,
actions from a turn's text, and each episode's seed from its dataset row.

Nothing here imports ``openenv`` at module level: the package is optional (``pip install -e '.[openenv]'``), and a
config that names the adapter must parse without it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import typing
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]
INSTALL = "pip install -e '.[openenv]'"


class OpenEnvMissing(ImportError, RuntimeError):
    """The optional ``openenv`` package is not installed (an ``ImportError``; a ``RuntimeError`` too, so that the
    command line prints it as one line)."""


class OpenEnvError(RuntimeError):
    """An OpenEnv environment or server failed in a way the run cannot go on from: unreachable, gone, too slow, at
    capacity, or answering with something that does not validate. The message is one line naming it."""


def require_openenv(what: str) -> None:
    """Import OpenEnv's core, or stop with one line naming ``what`` needs it and the extra that installs it."""
    try:
        importlib.import_module("openenv.core.env_server.types")
    except ImportError as error:
        raise OpenEnvMissing(f"{what} needs the optional package openenv, which is not installed ({error}): "
                             f"{INSTALL}") from None


def import_object(path: str, what: str) -> Any:
    """The object at import path ``path`` (``package.module.Name``), or one line naming ``what`` it was for."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{what}: expected an import path such as my_envs.game.GameEnvironment, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except OpenEnvMissing:
        raise
    except ImportError as error:
        raise ValueError(f"{what} {path!r}: module {module_name!r} cannot be imported ({error}); it must be "
                         "importable from where you run (or on PYTHONPATH)") from None
    if not hasattr(module, name):
        raise ValueError(f"{what} {path!r}: {module_name} has no {name!r}")
    return getattr(module, name)


def environment_types(env_class: type) -> tuple[type | None, type | None]:
    """``(action class, observation class)`` of an OpenEnv environment class, read from its generic base
    (``Environment[MyAction, MyObservation, MyState]``), else from its ``step``'s type hints; None where neither
    says."""
    from openenv.core.env_server.types import Action, Observation

    for klass in env_class.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            arguments = [a for a in typing.get_args(base) if isinstance(a, type)]
            action = next((a for a in arguments if issubclass(a, Action)), None)
            observation = next((a for a in arguments if issubclass(a, Observation)), None)
            if action is not None or observation is not None:
                return action, observation
    try:
        hints = typing.get_type_hints(env_class.step)
    except Exception:  # noqa: BLE001 - hints that do not resolve say nothing
        return None, None
    action, observation = hints.get("action"), hints.get("return")
    return (action if isinstance(action, type) and issubclass(action, Action) else None,
            observation if isinstance(observation, type) and issubclass(observation, Observation) else None)


def text_field_of(action_class: type, given: str | None) -> str:
    """The action field that takes the turn's text: ``given``, else the action's one required field."""
    fields = {name: info for name, info in action_class.model_fields.items() if name != "metadata"}
    if given is not None:
        if given not in fields:
            raise ValueError(f"text_field: {action_class.__name__} has no field {given!r} (its fields: "
                             f"{', '.join(fields) or 'none'})")
        return given
    required = [name for name, info in fields.items() if info.is_required()]
    if len(required) != 1:
        raise ValueError(f"text_field: {action_class.__name__} has {len(required)} required fields "
                         f"({', '.join(required) or 'none'}); name the one that takes the policy's text")
    return required[0]


def as_dict(observation: Any, where: str) -> dict[str, Any]:
    """An observation as a plain dict of its fields, reward, done and metadata left out (a pydantic model, or the
    dict a generic client returns); anything else is one line."""
    if hasattr(observation, "model_dump"):
        return observation.model_dump(exclude={"reward", "done", "metadata"})
    if isinstance(observation, dict):
        return {key: value for key, value in observation.items() if key not in ("reward", "done", "metadata")}
    raise OpenEnvError(f"{where}: the observation is a {type(observation).__name__}, not an OpenEnv Observation "
                       "(a pydantic model) or its fields")


def observation_messages(observation: dict[str, Any], field: str | None, role: str, where: str) -> list[Message]:
    """The messages the policy reads of an observation: its ``field`` (else its one field, else its ``messages``):
    text becomes one ``role`` message, a list of chat messages is taken as it is, anything else is written as
    JSON."""
    if field is None:
        field = "messages" if "messages" in observation else (next(iter(observation)) if len(observation) == 1
                                                              else None)
        if field is None:
            raise OpenEnvError(f"{where}: the observation has {len(observation)} fields ({', '.join(observation)}); "
                               "set observation_field to the one the policy reads")
    if field not in observation:
        raise OpenEnvError(f"{where}: the observation has no field {field!r} (its fields: "
                           f"{', '.join(observation) or 'none'}); set observation_field to one of them")
    value = observation[field]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return [dict(m) for m in value] if value else []
    return [{"role": role, "content": value if isinstance(value, str) else json.dumps(value, default=str)}]


def reward_of(reward: Any, where: str) -> float:
    """An observation's reward as a float (None = 0), or one line when it is not a finite number."""
    if reward is None:
        return 0.0
    if isinstance(reward, bool | int | float) and math.isfinite(float(reward)):
        return float(reward)
    raise OpenEnvError(f"{where}: the observation's reward is {reward!r}; expected a finite number or null")


def policy_error(error: Any, field: str) -> str | None:
    """The reason a pydantic ``ValidationError`` of an action built from the turn's text puts on the text itself
    (the policy's mistake, for it to read), or None when it lies elsewhere (the configuration's)."""
    problems = error.errors()
    if problems and all(tuple(p.get("loc", ())) == (field,) for p in problems):
        return "; ".join(f"{field}: {p.get('msg', 'invalid')}" for p in problems)
    return None


def validation_text(error: Any) -> str:
    """A pydantic ``ValidationError`` on one line: ``field: message`` per problem."""
    return "; ".join(f"{'.'.join(map(str, p.get('loc', ()))) or '(the action)'}: {p.get('msg', 'invalid')}"
                     for p in error.errors())


def run_seed(seed: int | None) -> int:
    """The run's seed of episodes: ``seed``, else the one ``seed_everything`` set (``PL_GLOBAL_SEED``), else 0."""
    if seed is not None:
        return seed
    value = os.environ.get("PL_GLOBAL_SEED", "")
    return int(value) if value.lstrip("-").isdigit() else 0


def episode_seed(row: dict[str, Any], seed: int, column: str) -> int:
    """The seed an episode's environment is reset with: the row's ``column`` as it is (a dataset that fixes its
    games), else a hash of the run's ``seed`` and the row (its prompt and columns), so a resumed run, or a later
    epoch, replays the row's episode, and every episode of a group plays the same one."""
    value = row.get(column)
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"the row's {column!r} is {value!r}; an OpenEnv seed is a non-negative integer")
        return value
    text = json.dumps([seed, row], sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


@dataclass(frozen=True)
class RemoteTool:
    """An MCP tool of an OpenEnv environment as the chat template shows it (``schema``); the environment runs it."""

    name: str
    schema: dict[str, Any]

    @classmethod
    def from_listing(cls, tool: Any) -> RemoteTool:
        """From a ``ListToolsObservation`` entry (a model or its dict: ``name``, ``description``,
        ``input_schema``)."""
        values = tool.model_dump() if hasattr(tool, "model_dump") else dict(tool)
        parameters = values.get("input_schema") or {"type": "object", "properties": {}}
        return cls(values["name"], {"type": "function", "function": {
            "name": values["name"], "description": values.get("description") or "", "parameters": parameters}})


def tool_result_text(observation: dict[str, Any]) -> tuple[str, bool]:
    """A ``CallToolObservation``'s result as the text the model reads, and whether the call failed (an ``error``
    of the framework, or a result marked as an error)."""
    error = observation.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else getattr(error, "message", error)
        return f"error: {message}", True
    result = observation.get("result")
    if hasattr(result, "content"):  # fastmcp's CallToolResult, in the process
        result = {"content": [getattr(c, "model_dump", lambda c=c: c)() for c in result.content],
                  "is_error": getattr(result, "is_error", False), "data": getattr(result, "data", None)}
    if isinstance(result, dict):
        failed = bool(result.get("is_error") or result.get("isError"))
        texts = [c.get("text") for c in result.get("content") or [] if isinstance(c, dict) and c.get("text")]
        if texts:
            return "\n".join(texts), failed
        if result.get("data") is not None:
            return _text(result["data"]), failed
        if result.get("structured_content") is not None:
            return _text(result["structured_content"]), failed
    return _text(result), False


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)
