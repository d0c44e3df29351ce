"""An OpenEnv server for an environment class, on OpenEnv's own FastAPI app (``create_app``: HTTP and the
WebSocket sessions its ``EnvClient`` uses), started by the user or by the fit.

By the user, in a terminal of its own (the episodes then name it by ``base_url: http://127.0.0.1:8000``)::

    python -m rlhf_lightning.environments.openenv_server --env rlhf_lightning.environments.guess_number.GuessNumberEnvironment --port 8000

By the fit (``serve: true`` in ``OpenEnvEnvironment``): :func:`started_server` starts one per environment and
arguments on a free port of 127.0.0.1, waits for its ``/health``, and stops it when the process ends (a server
whose fit is killed is sent SIGTERM by the kernel: ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from rlhf_lightning.environments.openenv_support import (
    OpenEnvError,
    environment_types,
    import_object,
    require_openenv,
)
from rlhf_lightning.utils.retrying import GaveUp, RetryPolicy, Transient, keep_trying

PR_SET_PDEATHSIG = 1  # prctl's option: the signal a child gets when its parent dies
STARTUP_TIMEOUT = 120.0  # seconds a started server may take to answer /health (importing OpenEnv takes a few)


def make_app(env: str, env_args: dict[str, Any] | None = None, max_concurrent_envs: int = 256) -> Any:
    """OpenEnv's app for the environment class at import path ``env`` made with ``env_args``, serving at most
    ``max_concurrent_envs`` sessions; its action and observation classes are read from the class (OpenEnv's
    ``Action``/``Observation`` where it does not say, as MCP environments take)."""
    require_openenv("an OpenEnv server")
    from openenv.core.env_server.exceptions import ConcurrencyConfigurationError
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.types import Action, Observation

    env_class = import_object(env, "--env")
    action, observation = environment_types(env_class)
    factory = functools.partial(env_class, **env_args) if env_args else env_class
    try:
        return create_app(factory, action or Action, observation or Observation, env_name=env_class.__name__,
                          max_concurrent_envs=max_concurrent_envs)
    except ConcurrencyConfigurationError:
        raise ValueError(f"{env_class.__name__} does not declare SUPPORTS_CONCURRENT_SESSIONS = True, so OpenEnv "
                         f"serves it one session at a time, and max_concurrent_envs is {max_concurrent_envs}: an "
                         "iteration's episodes run side by side, each in a session of its own; if its instances "
                         "share no state, set the flag on the class") from None


def main(argv: list[str] | None = None) -> None:
    """``python -m rlhf_lightning.environments.openenv_server --env package.module.Class [--env-args JSON]
    [--host 127.0.0.1] [--port 8000] [--max-concurrent-envs 256]``."""
    parser = argparse.ArgumentParser(prog="python -m rlhf_lightning.environments.openenv_server",
                                     description="Serve an OpenEnv environment class (HTTP and WebSocket sessions).")
    parser.add_argument("--env", required=True, help="import path of the OpenEnv Environment class")
    parser.add_argument("--env-args", default="{}", help="its constructor's arguments, as a JSON object")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-concurrent-envs", type=int, default=256,
                        help="sessions at once (one per episode running; an iteration runs batch x group)")
    arguments = parser.parse_args(argv)
    try:
        env_args = json.loads(arguments.env_args)
        if not isinstance(env_args, dict):
            raise ValueError("not a JSON object")
        app = make_app(arguments.env, env_args, arguments.max_concurrent_envs)
    except (ValueError, RuntimeError) as error:
        parser.exit(2, f"error: {error}\n")
    import uvicorn

    uvicorn.run(app, host=arguments.host, port=arguments.port, log_level="warning")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the fit that started it dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class StartedServer:
    """An OpenEnv server this process started on 127.0.0.1, its output in a log file.

    Args:
        env: import path of the environment class.
        env_args: its constructor's arguments.
        max_concurrent_envs: sessions at once.
    """

    def __init__(self, env: str, env_args: dict[str, Any], max_concurrent_envs: int) -> None:
        self.env = env
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(tempfile.mkdtemp(prefix="openenv-server-")) / "server.log"
        command = [sys.executable, "-m", "rlhf_lightning.environments.openenv_server", "--env", env, "--env-args",
                   json.dumps(env_args), "--port", str(port), "--max-concurrent-envs", str(max_concurrent_envs)]
        # The server imports what the fit imports: the environment's module may be on the fit's path only.
        paths = [os.getcwd(), *(path for path in sys.path if path and os.path.isdir(path))]
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(
            [*paths, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))}
        with self.log.open("w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                            preexec_fn=_die_with_parent)  # noqa: PLW1509 - prctl only, no locks
        atexit.register(self.stop)
        self.wait_until_healthy()

    def wait_until_healthy(self) -> None:
        def healthy() -> None:
            if self.process.poll() is not None:
                raise OpenEnvError(self.exited())
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
                    raise Transient(f"/health answered {response.status}")
            except OSError as error:
                raise Transient(str(getattr(error, "reason", error))) from None

        policy = RetryPolicy(retries=0, retry_for=STARTUP_TIMEOUT, backoff=0.2, max_backoff=0.2,
                             setting="")
        try:
            keep_trying(healthy, policy, f"the OpenEnv server started for {self.env} at {self.url}", waiting=True)
        except GaveUp:
            self.stop()
            raise OpenEnvError(f"the OpenEnv server started for {self.env} did not answer {self.url}/health within "
                               f"{STARTUP_TIMEOUT:g} s; its log: {self.log}") from None

    def exited(self) -> str:
        """One line: the server exited, with its code and the last line of its log."""
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        last = lines[-1].strip()[:300] if lines else "(empty)"
        return (f"the OpenEnv server started for {self.env} exited with code {self.process.returncode}; its log: "
                f"{self.log} (last line: {last})")

    def explain(self, error: OpenEnvError) -> OpenEnvError:
        """``error``, with the server's exit and log when it is no longer running."""
        try:  # a server that crashed closes its sockets a moment before its exit can be seen
            self.process.wait(1.0)
        except subprocess.TimeoutExpired:
            return error
        return OpenEnvError(f"{error}; {self.exited()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:  # a server still running a step that never returns does not stop on SIGTERM alone
                self.process.wait(3)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_STARTED: dict[str, StartedServer] = {}


def started_server(env: str, env_args: dict[str, Any], max_concurrent_envs: int) -> StartedServer:
    """The server this process started for ``env`` with ``env_args`` (started now, the first time)."""
    key = json.dumps([env, env_args, max_concurrent_envs], sort_keys=True, default=str)
    server = _STARTED.get(key)
    if server is None:
        server = _STARTED[key] = StartedServer(env, env_args, max_concurrent_envs)
    return server


if __name__ == "__main__":
    main()
