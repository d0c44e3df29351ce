"""OpenEnv environments as episodes: :class:`OpenEnvEnvironment` turns an OpenEnv ``Environment`` (run in this
process) or an OpenEnv server (through its ``EnvClient``, started by the user or by the fit on 127.0.0.1) into an
:class:`~rlhf_lightning.environments.Environment`.

Each episode opens one OpenEnv session (``reset(seed=...)``), sends each of the policy's turns as an action and
closes the session when the episode ends:

- observation -> messages: the observation's text field becomes a ``user`` message (a list of chat messages is
  taken as it is); the opening is the reset observation's (the row's prompt when it has no field);
- the policy's turn -> action: its text fills the action's text field (``GuessAction(guess="12")``, validated by
  the action's pydantic class); with ``mcp_tools``, its tool calls, parsed in the base's chat-template format,
  become MCP ``CallToolAction``\\ s and their results ``tool`` messages;
- the observation's ``reward`` (None = 0) and ``done`` -> :class:`~rlhf_lightning.environments.Step`.

A turn whose text does not validate as the action, and a tool call that fails, are the policy's mistakes: it reads
the error and the episode goes on (counted: ``invalid_actions``, ``tool_errors``). What the run cannot go on from is
one line: the package missing, a server unreachable or gone, an environment that does not answer within
``timeout``, an observation that does not validate, the server's session limit below the episodes of an iteration.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any

from rlhf_lightning.environments.environment import Environment, Message, Step
from rlhf_lightning.environments.openenv_sessions import EventLoop, LocalSession, RemoteSession, Result
from rlhf_lightning.environments.openenv_support import (
    OpenEnvError,
    RemoteTool,
    environment_types,
    episode_seed,
    import_object,
    observation_messages,
    policy_error,
    require_openenv,
    reward_of,
    run_seed,
    text_field_of,
    tool_result_text,
    validation_text,
)
from rlhf_lightning.utils.http import EndpointError, request_json

if TYPE_CHECKING:
    from rlhf_lightning.environments.openenv_server import StartedServer


class _Source:
    """Where an adapter's sessions come from, resolved once per configuration (episodes make the adapter anew each
    time): the environment class or the server, the action class and its text field, the MCP tools. It owns the
    server it started and the event loop of its remote sessions, until :meth:`close` (at the end of the fit)."""

    def __init__(self, env: str | None, env_args: dict[str, Any], base_url: str | None, serve: bool,
                 max_concurrent_envs: int, client: str | None, action: str | None, text_field: str | None,
                 mcp_tools: bool, timeout: float) -> None:
        require_openenv("OpenEnvEnvironment")
        from openenv.core.generic_client import GenericEnvClient

        # imported here: `python -m rlhf_lightning.environments.openenv_server` imports this package first
        from rlhf_lightning.environments.openenv_server import StartedServer

        self.timeout, self.mcp_tools, self.env_args = timeout, mcp_tools, env_args
        self.env_class = import_object(env, "OpenEnvEnvironment env") if env is not None else None
        self.server: StartedServer | None = StartedServer(env, env_args, max_concurrent_envs) if serve else None
        self.url = (base_url or "").rstrip("/") or None
        self.name = self.env_class.__name__ if self.env_class is not None else self.url
        self.loop = EventLoop()
        self.client_class = (import_object(client, "OpenEnvEnvironment client") if client is not None
                             else GenericEnvClient)
        inferred = environment_types(self.env_class)[0] if self.env_class is not None else None
        self.action_class = import_object(action, "OpenEnvEnvironment action") if action is not None else inferred
        self.text_field = text_field
        if self.action_class is not None:
            try:
                self.text_field = text_field_of(self.action_class, text_field)
            except ValueError:
                if text_field is not None or not mcp_tools:
                    raise  # an MCP environment's generic action takes tool calls only: no text field to find
        if self.text_field is None and not mcp_tools:
            raise ValueError(f"OpenEnvEnvironment {self.name}: no action takes the policy's text: name the action "
                             "class (action: my_env.models.MyAction) or its text field (text_field), or set "
                             "mcp_tools: true for an environment driven by tool calls")
        self.live = 0  # sessions of this source open in this process
        self._tools: dict[str, RemoteTool] | None = None
        if self.server is not None:  # started last: a configuration refused above leaves no server behind
            self.url = self.server.start()
        elif self.url is not None:
            self.check_reachable()

    def check_reachable(self) -> None:
        try:
            request_json("GET", f"{self.url}/health", None, timeout=min(self.timeout, 10.0), text=True)
        except EndpointError as error:
            raise OpenEnvError(f"cannot reach the OpenEnv server at {self.url} ({error.transport or error.reason}); "
                               "start it (python -m rlhf_lightning.environments.openenv_server --env ...) or correct "
                               "base_url") from None

    def open(self) -> LocalSession | RemoteSession:
        """A new session: an environment object made here, or a session of the server (opened by its reset)."""
        if self.url is not None:
            return RemoteSession(self.client_class, self.url, self.timeout, self.loop)
        if self.live and not getattr(self.env_class, "SUPPORTS_CONCURRENT_SESSIONS", False):
            raise OpenEnvError(f"OpenEnv environment {self.name} does not declare SUPPORTS_CONCURRENT_SESSIONS = "
                               "True, so one session may run at a time, and an iteration runs its episodes side by "
                               "side; if its instances share no state, set the flag on the class")
        self.live += 1
        return LocalSession(functools.partial(self.env_class, **self.env_args), self.name, self.timeout)

    def explain(self, error: OpenEnvError) -> OpenEnvError:
        return self.server.explain(error) if self.server is not None else error

    @property
    def tools(self) -> dict[str, RemoteTool]:
        """The environment's MCP tools (listed once, in a session of their own), or none without ``mcp_tools``."""
        if not self.mcp_tools:
            return {}
        if self._tools is None:
            from openenv.core.env_server.mcp_types import ListToolsAction

            session = self.open()
            try:
                listing = session.step(ListToolsAction())
            except OpenEnvError as error:
                raise self.explain(error) from None
            finally:
                session.close()
                self.live -= isinstance(session, LocalSession)
            if listing.observation.get("metadata", {}).get("error") or "tools" not in listing.observation:
                raise OpenEnvError(f"OpenEnv environment {self.name} lists no MCP tools (mcp_tools: true): "
                                   f"{listing.observation}")
            self._tools = {t.name: t for t in map(RemoteTool.from_listing, listing.observation["tools"])}
        return self._tools

    def close(self) -> None:
        """Stop the event loop of its sessions and the server it started (the fit's teardown)."""
        self.loop.close()
        if self.server is not None:
            self.server.stop()


_SOURCES: dict[str, _Source] = {}  # configuration -> its source, until the fit's teardown closes it
_SOURCES_LOCK = threading.Lock()  # one source (one server) per configuration, whichever thread asks first


def _source(key: str) -> _Source:
    with _SOURCES_LOCK:
        if key not in _SOURCES:
            _SOURCES[key] = _Source(**json.loads(key))
        return _SOURCES[key]


def close_sources(key: str | None = None) -> None:
    """Close the source of configuration ``key`` (None: every source of this process): its server stopped, its
    event loop's thread ended; a later episode of the configuration resolves it anew (a server started again)."""
    with _SOURCES_LOCK:
        closing = [_SOURCES.pop(k) for k in ([key] if key is not None else list(_SOURCES)) if k in _SOURCES]
    for source in closing:
        source.close()


class OpenEnvEnvironment(Environment):
    """An OpenEnv environment as the environment of episodes: one OpenEnv session per episode, closed after it.

    Args:
        env: import path of an OpenEnv ``Environment`` class, run in this process (one object per episode), or, with
            ``serve``, on a server the fit starts.
        env_args: the environment class's constructor arguments.
        base_url: an OpenEnv server started by you (``http://host:port``), instead of ``env``.
        serve: start ``env`` on an OpenEnv server on 127.0.0.1 for the fit (stopped with it) and talk to it over
            WebSocket sessions, as to a server of one's own.
        max_concurrent_envs: the sessions a started server holds at once; an iteration runs ``data.batch_size x
            samples_per_prompt`` episodes side by side, one session each.
        client: import path of the server's ``EnvClient`` subclass; null = OpenEnv's ``GenericEnvClient``.
        action: import path of the environment's ``Action`` class; null = read from ``env``'s class. Actions are
            validated here before they are sent.
        text_field: the action's field that takes the policy's text; null = the action's one required field.
        observation_field: the observation's field the policy reads; null = its one field (or ``messages``).
        role: the role of the messages made of observations.
        mcp_tools: show the environment's MCP tools to the model (through the chat template) and send the turn's
            tool calls as ``CallToolAction``; a turn without a call is the text action, or ends the episode when
            there is none.
        seed: the run's seed of episodes; null = the one ``seed_everything`` set. An episode's seed is its row's
            ``seed_column`` when the row has one, else a hash of this seed and the row, so a resumed run replays
            the same episodes and a group's episodes play the same one.
        seed_column: the dataset column that holds each row's episode seed.
        timeout: seconds a session may take to open, reset or step before the run stops with one line.
    """

    def __init__(self, env: str | None = None, env_args: dict[str, Any] | None = None, base_url: str | None = None,
                 serve: bool = False, max_concurrent_envs: int = 256, client: str | None = None,
                 action: str | None = None, text_field: str | None = None, observation_field: str | None = None,
                 role: str = "user", mcp_tools: bool = False, seed: int | None = None, seed_column: str = "seed",
                 timeout: float = 30.0) -> None:
        if (env is None) == (base_url is None):
            raise ValueError("OpenEnvEnvironment: give env (an OpenEnv Environment class, run in this process or, "
                             "with serve: true, on a server the fit starts) or base_url (a server of yours), not "
                             f"{'both' if env is not None else 'neither'}")
        if serve and env is None:
            raise ValueError("OpenEnvEnvironment: serve: true starts env on a server; env is not set")
        if not timeout > 0 or max_concurrent_envs < 1:
            raise ValueError(f"OpenEnvEnvironment: timeout must be > 0 and max_concurrent_envs >= 1, got {timeout} "
                             f"and {max_concurrent_envs}")
        self.key = json.dumps(dict(
            env=env, env_args=env_args or {}, base_url=base_url, serve=serve, max_concurrent_envs=max_concurrent_envs,
            client=client, action=action, text_field=text_field, mcp_tools=mcp_tools, timeout=timeout),
            sort_keys=True)
        self.source = _source(self.key)
        self.observation_field, self.role = observation_field, role
        self.seed, self.seed_column = seed, seed_column
        self.session: LocalSession | RemoteSession | None = None
        self.counts: Counter = Counter()

    @property
    def tools(self) -> dict[str, RemoteTool]:  # type: ignore[override] - the environment's, shown by the template
        return self.source.tools

    def _call(self, method: str, *arguments: Any) -> Result:
        try:
            return getattr(self.session, method)(*arguments)
        except OpenEnvError as error:
            self.close()
            raise self.source.explain(error) from None

    def reset(self, row: dict[str, Any]) -> list[Message]:
        """Open the episode's session, reset with the row's seed; the opening is the reset observation."""
        seed = episode_seed(row, run_seed(self.seed), self.seed_column)
        self.close()
        try:
            self.session = self.source.open()
        except OpenEnvError as error:
            raise self.source.explain(error) from None
        result = self._call("reset", seed)
        if not result.observation:  # nothing to read (an MCP environment's bare Observation): the row's prompt
            return super().reset(row)
        return observation_messages(result.observation, self.observation_field, self.role,
                                    f"OpenEnv environment {self.source.name}, reset(seed={seed})")

    def step(self, messages: list[Message]) -> Step:
        """Send the policy's turn (its tool calls, or its text as the action) and answer with the observation."""
        if self.session is None:
            raise OpenEnvError(f"OpenEnv environment {self.source.name}: step before reset, or after the episode "
                               "ended")
        turn = messages[-1]
        calls, invalid = turn.get("tool_calls") or [], turn.get("invalid_tool_calls") or []
        if self.source.mcp_tools and (calls or invalid):
            return self._finish(self._tool_step(calls, invalid))
        if self.source.text_field is None:
            return self._finish(Step(done=True))
        return self._finish(self._text_step(turn.get("content") or ""))

    def _text_step(self, text: str) -> Step:
        field = self.source.text_field
        action: Any = {field: text.strip()}
        if self.source.action_class is not None:
            from pydantic import ValidationError

            try:
                action = self.source.action_class.model_validate(action)
            except ValidationError as error:
                reason = policy_error(error, field)
                if reason is None:  # not the text's fault: the action needs more than the text
                    raise OpenEnvError(f"OpenEnv environment {self.source.name}: the action "
                                       f"{self.source.action_class.__name__} does not validate from the turn's text "
                                       f"in {field!r}: {validation_text(error)}") from None
                return Step([{"role": self.role, "content": f"error: {reason}"}], counts=Counter(invalid_actions=1))
        return self._answer(self._call("step", action), "step")

    def _tool_step(self, calls: list[dict[str, Any]], invalid: list[str]) -> Step:
        from openenv.core.env_server.mcp_types import CallToolAction

        step = Step(counts=Counter(invalid_tool_calls=len(invalid)))
        step.messages += [{"role": "tool", "name": "error", "content": f"error: {error}"} for error in invalid]
        for call in calls:
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            step.counts["tool_calls"] += 1
            step.counts[f"tool_calls/{name if name in self.tools else 'unknown'}"] += 1
            if not isinstance(arguments, dict):
                step.counts["tool_errors"] += 1
                step.messages.append({"role": "tool", "name": name, "content": f"error: the arguments of {name} "
                                      f"must be a JSON object, got {arguments!r}"})
                continue
            result = self._call("step", CallToolAction(tool_name=name, arguments=arguments))
            text, failed = tool_result_text(result.observation)
            step.counts["tool_errors"] += failed
            step.reward += reward_of(result.reward, f"OpenEnv environment {self.source.name}, {name}")
            if result.done:
                step.done, step.messages = True, []
                break
            step.messages.append({"role": "tool", "name": name, "content": text})
        return step

    def _answer(self, result: Result, what: str) -> Step:
        where = f"OpenEnv environment {self.source.name}, {what}"
        reward = reward_of(result.reward, where)
        if result.done:
            return Step(reward=reward, done=True)
        return Step(observation_messages(result.observation, self.observation_field, self.role, where), reward)

    def _finish(self, step: Step) -> Step:
        self.counts.update(step.counts)
        if step.done:
            self.close()
        return step

    def close_shared(self) -> None:
        """At the end of the fit: close what every episode of this configuration shares, the server the fit started
        and the event loop of the server's sessions."""
        close_sources(self.key)

    def close(self) -> None:
        """Close the episode's session (once; the rollout closes every episode's environment when it ends)."""
        session, self.session = self.session, None
        if session is not None:
            session.close()
            if isinstance(session, LocalSession):
                self.source.live -= 1
