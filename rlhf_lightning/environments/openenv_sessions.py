"""One OpenEnv environment session per episode: an environment object in this process (:class:`LocalSession`) or a
WebSocket session of an OpenEnv server through its ``EnvClient`` (:class:`RemoteSession`).

Every call has a timeout and every failure is one line (:class:`~.openenv_support.OpenEnvError`) naming the
environment or server and what went wrong: unreachable, gone mid-episode, too slow, at capacity, or answering with
something that does not validate. The clients of an adapter's remote sessions run on one event loop in one
background thread (:class:`EventLoop`, not a thread per session, as ``SyncEnvClient`` would start), stopped when the
adapter's source closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_lightning.environments.openenv_support import OpenEnvError, as_dict, validation_text
from rlhf_lightning.utils.retrying import GaveUp, RetryPolicy, Transient, keep_trying

_CLOSE_TIMEOUT = 5.0  # seconds a session's close may take; a server that is gone cannot hold the run up
_SERVER_ERROR = re.compile(r"Server error: (.*) \(code: (\w+)\)$", re.S)
_CAPACITY = re.compile(r"\d+/(\d+) sessions")  # OpenEnv's "Server at capacity: 4/4 sessions active"


@dataclass
class Result:
    """What a reset or step answered: the observation's fields, its reward (None = none) and ``done``."""

    observation: dict[str, Any]
    reward: Any = None
    done: bool = False


def _call_with_timeout(function: Callable[[], Any], timeout: float, what: str) -> Any:
    """``function()`` in a daemon thread, or one line after ``timeout`` seconds (Python cannot stop the thread: it
    is abandoned, and the process does not wait for it)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - reported below, in the caller's thread
            outcome["error"] = error

    worker = threading.Thread(target=run, daemon=True, name=f"openenv {what}")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise OpenEnvError(f"{what} did not return within {timeout:g} s (the adapter's timeout)")
    if "error" in outcome:
        error = outcome["error"]
        raise OpenEnvError(f"{what} raised {type(error).__name__}: {error}".replace("\n", " ")) from error
    return outcome["value"]


def _checked_observation(observation: Any, what: str) -> Result:
    """An in-process environment's observation, validated again against its own class (a value set without
    validation, ``model_construct``, is caught here), as a :class:`Result`."""
    from openenv.core.env_server.types import Observation
    from pydantic import ValidationError

    if not isinstance(observation, Observation):
        raise OpenEnvError(f"{what} returned a {type(observation).__name__}, not an OpenEnv Observation")
    try:
        type(observation).model_validate(observation.model_dump())
    except ValidationError as error:
        raise OpenEnvError(f"{what} returned an observation ({type(observation).__name__}) that does not validate: "
                           f"{validation_text(error)}") from None
    return Result(as_dict(observation, what), observation.reward, observation.done)


class LocalSession:
    """An OpenEnv environment object in this process, made for one episode.

    Args:
        factory: makes the environment (its class with its arguments).
        name: the environment's name, for messages.
        timeout: seconds a reset or step may take.
    """

    def __init__(self, factory: Callable[[], Any], name: str, timeout: float) -> None:
        self.name, self.timeout = name, timeout
        self.env = _call_with_timeout(factory, timeout, f"OpenEnv environment {name}: making it")

    def reset(self, seed: int) -> Result:
        what = f"OpenEnv environment {self.name}: reset(seed={seed})"
        return _checked_observation(_call_with_timeout(lambda: self.env.reset(seed=seed), self.timeout, what), what)

    def step(self, action: Any) -> Result:
        what = f"OpenEnv environment {self.name}: step({type(action).__name__})"
        return _checked_observation(_call_with_timeout(lambda: self.env.step(action), self.timeout, what), what)

    def close(self) -> None:
        env, self.env = self.env, None
        if env is not None:
            # the episode is over; a close that fails or hangs changes nothing it produced
            with contextlib.suppress(OpenEnvError):
                _call_with_timeout(env.close, _CLOSE_TIMEOUT, f"OpenEnv environment {self.name}: close")


class EventLoop:
    """One asyncio event loop in a daemon thread, for the clients of the remote sessions of one owner (an
    adapter's source of sessions): started at the first session, stopped, its thread joined, by :meth:`close`
    (the owner's, at the end of the fit); a session after that starts it anew."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or not self._loop.is_running():
                loop = asyncio.new_event_loop()
                started = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(started.set)
                    try:
                        loop.run_forever()
                    finally:  # what a session left running is cancelled, and the loop closed with its thread
                        pending = asyncio.all_tasks(loop)
                        for task in pending:
                            task.cancel()
                        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                        loop.close()

                self._thread = threading.Thread(target=run, daemon=True, name="openenv clients")
                self._thread.start()
                started.wait()
                self._loop = loop
            return self._loop

    def close(self) -> None:
        """Stop the loop and join its thread (at most :data:`_CLOSE_TIMEOUT` seconds); nothing if none runs."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None and thread is not None:
            with contextlib.suppress(RuntimeError):  # closed already
                loop.call_soon_threadsafe(loop.stop)
            thread.join(_CLOSE_TIMEOUT)


class RemoteSession:
    """A session of an OpenEnv server, through its ``EnvClient`` (one WebSocket, one environment on the server),
    for one episode. The server's session limit is respected: a session refused at capacity is retried until
    ``timeout`` while other clients' sessions may end, and stops the run at once when this process alone holds the
    server's every session (an iteration's episodes run side by side, so waiting could not help).

    Args:
        client_class: the ``EnvClient`` subclass (OpenEnv's ``GenericEnvClient``: actions and observations as dicts).
        url: the server's base URL (``http://host:port``).
        timeout: seconds a connection, reset or step may take.
        loop: the event loop its client runs on (its owner's).
    """

    open_sessions: Counter = Counter()  # url -> this process's open sessions

    def __init__(self, client_class: type, url: str, timeout: float, loop: EventLoop) -> None:
        self.url, self.timeout, self.loop = url, timeout, loop
        self.client = client_class(base_url=url, connect_timeout_s=timeout, message_timeout_s=timeout)
        self.client_class_name = client_class.__name__
        self.opened = False

    def _run(self, make: Callable[[], Any], what: str, timeout: float | None = None) -> Any:
        """Await ``make()`` on the clients' loop, each failure one line."""
        from pydantic import ValidationError
        from websockets.exceptions import ConnectionClosed

        timeout = self.timeout if timeout is None else timeout
        where = f"OpenEnv server {self.url}"
        future = asyncio.run_coroutine_threadsafe(_awaited(make), self.loop.get())
        try:
            return future.result(timeout + 5.0)  # the client's own timeouts come first; this one is the backstop
        except (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            raise OpenEnvError(f"{where} did not answer {what} within {timeout:g} s (the adapter's timeout)") from None
        except ValidationError as error:  # a typed client's models refused what the server answered
            raise OpenEnvError(f"{where}: the answer to {what} does not validate as {self.client_class_name}'s "
                               f"models: {validation_text(error)}") from None
        except ConnectionClosed as error:
            raise OpenEnvError(f"{where} closed the connection during {what}: the server stopped or crashed "
                               f"({error})") from None
        except ConnectionError as error:
            raise OpenEnvError(f"cannot reach the {where} during {what} ({_reason(error)}); start it (python -m "
                               "rlhf_lightning.environments.openenv_server --env ...) or correct base_url") from None
        except RuntimeError as error:
            found = _SERVER_ERROR.match(str(error))
            if found is None:
                raise OpenEnvError(f"{where}: {what} failed: {error}") from None
            message, code = found.group(1).replace("\n", " ").rstrip(". "), found.group(2)
            raise _ServerRefusal(code, f"{where} refused {what} ({code}): {message}") from None

    def reset(self, seed: int) -> Result:
        what = f"reset(seed={seed})"

        def reset() -> Any:
            try:
                return self._run(lambda: self.client.reset(seed=seed), what)
            except _ServerRefusal as refusal:
                if refusal.code != "CAPACITY_REACHED":
                    raise OpenEnvError(str(refusal)) from None
                held, limit = RemoteSession.open_sessions[self.url], _CAPACITY.search(str(refusal))
                if held and limit is not None and held >= int(limit.group(1)):
                    raise self._held_here(refusal, held) from None
                raise Transient(str(refusal).removeprefix(f"OpenEnv server {self.url} ")) from None

        # Sessions of other clients, or of an episode just closed, may end meanwhile.
        policy = RetryPolicy(retries=0, retry_for=self.timeout, backoff=0.2, max_backoff=0.2,
                             setting="the adapter's timeout")
        try:
            result = keep_trying(reset, policy, f"OpenEnv server {self.url}")
        except GaveUp as gave_up:
            held = RemoteSession.open_sessions[self.url]
            refusal = f"OpenEnv server {self.url} {gave_up.reason}"
            if held:
                raise self._held_here(refusal, held) from None
            raise OpenEnvError(f"{refusal}, for {self.timeout:g} s (the adapter's timeout): other clients hold its "
                               "sessions") from None
        self.opened = True
        RemoteSession.open_sessions[self.url] += 1
        return self._result(result, what)

    @staticmethod
    def _held_here(refusal: object, held: int) -> OpenEnvError:
        return OpenEnvError(f"{refusal}; this process holds {held} of them, one per episode of the iteration running "
                            "side by side: start the server with a larger max_concurrent_envs, or run fewer episodes "
                            "at once (data.init_args.batch_size x samples_per_prompt)")

    def step(self, action: Any) -> Result:
        name = action.get("type", "action") if isinstance(action, dict) else type(action).__name__
        try:
            return self._result(self._run(lambda: self.client.step(action), f"step({name})"), f"step({name})")
        except _ServerRefusal as refusal:
            raise OpenEnvError(str(refusal)) from None

    def _result(self, result: Any, what: str) -> Result:
        return Result(as_dict(result.observation, f"OpenEnv server {self.url}, {what}"), result.reward, result.done)

    def close(self) -> None:
        client, self.client = self.client, None
        if client is None:
            return
        if self.opened:
            RemoteSession.open_sessions[self.url] -= 1
        with contextlib.suppress(OpenEnvError):  # the episode is over; a server that is gone holds no session
            self._run(client.close, "close", _CLOSE_TIMEOUT)


class _ServerRefusal(OpenEnvError):
    """The server answered with an error frame (its ``code``: CAPACITY_REACHED, VALIDATION_ERROR, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


async def _awaited(make: Callable[[], Any]) -> Any:
    """The value of ``make()`` awaited on the running loop (an ``EnvClient`` call made inside a running loop returns
    an awaitable)."""
    return await make()


def _reason(error: BaseException) -> str:
    """The innermost cause's message (``Connect call failed ...``), on one line."""
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error).replace("\n", " ")
