"""An OpenEnv server for an environment class, on OpenEnv's own FastAPI app (``create_app``: HTTP and the
WebSocket sessions its ``EnvClient`` uses), started by the user or by the fit.

By the user, in a terminal of its own (the episodes then name it by ``base_url: http://127.0.0.1:8000``)::

    python -m rlhf_lightning.environments.openenv_server --env rlhf_lightning.environments.guess_number.GuessNumberEnvironment --port 8000

By the fit (``serve: true`` in ``OpenEnvEnvironment``): a :class:`StartedServer` (a managed subprocess, as vLLM's
server the fit starts) per environment configuration, on a free port of 127.0.0.1, waited for at its ``/health``
and stopped at the end of the fit (a server whose fit is killed is sent SIGTERM by the kernel:
``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from rlhf_lightning.environments.openenv_support import (
    OpenEnvError,
    environment_types,
    import_object,
    require_openenv,
)
from rlhf_lightning.utils.managed_server import ManagedServer

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


class StartedServer(ManagedServer):
    """An OpenEnv server this process starts on 127.0.0.1 (:meth:`start`, or ``with``), its output in a log file
    of a temporary folder; its owner stops it (:meth:`stop`) when the fit ends.

    Args:
        env: import path of the environment class.
        env_args: its constructor's arguments.
        max_concurrent_envs: sessions at once.
    """

    error = OpenEnvError
    health_timeout, poll_every = 2.0, 0.2
    stop_after = 3.0  # a server still running a step that never returns does not stop on SIGTERM alone

    def __init__(self, env: str, env_args: dict[str, Any], max_concurrent_envs: int) -> None:
        super().__init__(f"the OpenEnv server started for {env}",
                         Path(tempfile.mkdtemp(prefix="openenv-server-")) / "server.log", "/health",
                         startup_timeout=STARTUP_TIMEOUT)
        self.env, self.env_args, self.max_concurrent_envs = env, env_args, max_concurrent_envs

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "rlhf_lightning.environments.openenv_server", "--env", self.env, "--env-args",
                json.dumps(self.env_args), "--port", str(port), "--max-concurrent-envs", str(self.max_concurrent_envs)]

    def environment(self) -> dict[str, str]:
        # The server imports what the fit imports: the environment's module may be on the fit's path only.
        paths = [os.getcwd(), *(path for path in sys.path if path and os.path.isdir(path))]
        return {**super().environment(), "PYTHONPATH": os.pathsep.join(dict.fromkeys(
            [*paths, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))}

    def explain(self, error: OpenEnvError) -> OpenEnvError:
        """``error``, with the server's exit and log when it is no longer running."""
        exited = self.exited(grace=1.0)
        return error if exited is None else OpenEnvError(f"{error}; {exited}")


if __name__ == "__main__":
    main()
