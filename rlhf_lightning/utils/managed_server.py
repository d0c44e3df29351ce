"""A server a fit starts, as one managed subprocess (vLLM's OpenAI-compatible server, an OpenEnv server): a free port
of 127.0.0.1, a process group of its own whose output goes to a log file, ended by the kernel when the thread that
started it dies (``PR_SET_PDEATHSIG``, Linux), a wait until it answers its health path, said aloud, the last line of
its log in the error of a server that exits, and an escalating stop (SIGTERM to its group, SIGKILL after a while).

Its owner stops it when the fit ends (at teardown); :func:`stop_all`, run at exit, is the last resort for a process
that ends without its teardown.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlhf_lightning.utils.http import EndpointError, request_json
from rlhf_lightning.utils.retrying import GaveUp, RetryPolicy, Transient, keep_trying

PR_SET_PDEATHSIG = 1  # prctl's option: the signal a child gets when its parent dies
TAIL_BYTES = 65536  # of a log read for its last line


def free_port() -> int:
    """A TCP port of 127.0.0.1 no one listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def last_line(log: Path, width: int = 300) -> str:
    """The last line of ``log`` that is not blank, at most ``width`` characters (``(empty)`` for none); only the
    file's tail is read."""
    try:
        with log.open("rb") as file:
            file.seek(max(file.seek(0, os.SEEK_END) - TAIL_BYTES, 0))
            tail = file.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    lines = [line for line in tail.splitlines() if line.strip()]
    return lines[-1].strip()[:width] if lines else "(empty)"


_RUNNING: set[ManagedServer] = set()
_RUNNING_LOCK = threading.Lock()


class ManagedServer:
    """A server this process starts on 127.0.0.1 and stops, its output in ``log``.

    ``command(port)`` (the argument, or a subclass's method) is its command line; :meth:`start` runs it and waits
    until ``GET health`` answers, at most ``startup_timeout`` seconds; :meth:`stop` ends it (idempotent). As a
    context manager it is started on entry (unless it runs) and stopped on exit.

    The kernel ends it (SIGTERM) when the *thread* that started it ends, even by SIGKILL: start it from a thread
    that lives as long as it should (the fit's main thread).

    Args:
        name: what the lines and errors call it (``the vLLM server the fit started``).
        log: the file its output goes to (made anew).
        health: the path that answers once it serves (``/health``); any answer below 400 will do.
        command: its command line for a port; None: the subclass's :meth:`command`.
        environment: its environment variables; None: this process's.
        cpus: CPU cores it is bound to; None: unbound.
        startup_timeout: seconds it may take to answer ``health``.
        setting: the setting the lines name for ``startup_timeout`` (``engine.init_args.startup_timeout``); empty:
            none.
    """

    error: Callable[[str], Exception] = RuntimeError  # the class of its one-line errors
    health_timeout = 5.0  # seconds one health check may take
    poll_every = 0.5  # seconds between two health checks
    stop_after = 30.0  # seconds between SIGTERM and SIGKILL

    def __init__(self, name: str, log: Path, health: str = "/health", *,
                 command: Callable[[int], Sequence[str]] | None = None, environment: dict[str, str] | None = None,
                 cpus: list[int] | None = None, startup_timeout: float = 120.0, setting: str = "") -> None:
        self.name, self.log, self.health = name, Path(log), health
        self._command, self._environment, self.cpus = command, environment, cpus
        self.startup_timeout, self.setting = startup_timeout, setting
        self.process: subprocess.Popen | None = None
        self.url: str | None = None

    def command(self, port: int) -> Sequence[str]:
        if self._command is None:
            raise NotImplementedError(f"{type(self).__name__}: give command, or define command(port)")
        return self._command(port)

    def environment(self) -> dict[str, str]:
        return dict(os.environ if self._environment is None else self._environment)

    # ---- start -----------------------------------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> str:
        """Start it on a free port and wait until it answers (``timeout``: seconds, else ``startup_timeout``): its
        URL. One line (:attr:`error`) when it exits first or does not answer in time; it is stopped then."""
        if self.running:
            return self.url
        timeout = self.startup_timeout if timeout is None else timeout
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        parent = os.getpid()
        with self.log.open("w") as log, _RUNNING_LOCK:
            self.process = subprocess.Popen(  # noqa: PLW1509 - prctl and affinity only, no locks
                list(self.command(port)), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                start_new_session=True, preexec_fn=lambda: self.in_child(parent))
            _RUNNING.add(self)
        try:
            self.wait_until_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self.url

    def in_child(self, parent: int) -> None:
        """In its process before the command runs: bound to ``cpus``, and SIGTERM when its parent dies (Linux;
        elsewhere :meth:`stop` alone). A parent gone before the request is made is caught at once."""
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)

    def wait_until_healthy(self, timeout: float) -> None:
        def answers() -> None:
            if self.process.poll() is not None:
                raise self.error(self.exited())
            try:
                request_json("GET", f"{self.url}{self.health}", None, timeout=self.health_timeout, what=self.name,
                             text=True)
            except EndpointError as failure:
                raise Transient(failure.reason) from None

        policy = RetryPolicy(retries=0, retry_for=timeout, backoff=self.poll_every, max_backoff=self.poll_every,
                             setting=self.setting)
        try:
            keep_trying(answers, policy, f"{self.name} at {self.url} (its log: {self.log})", waiting=True)
        except GaveUp:
            named = f" ({self.setting})" if self.setting else ""
            raise self.error(f"{self.name} did not answer {self.url}{self.health} within {timeout:g} s{named}; its "
                             f"log: {self.log}") from None

    # ---- while it runs ---------------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exited(self, grace: float = 0.0) -> str | None:
        """One line when it has exited (waited for up to ``grace`` seconds: a server that crashed closes its sockets
        a moment before its exit can be seen): its exit code and the last line of its log; None while it runs."""
        if self.process is None:
            return None
        try:
            code = self.process.wait(grace) if grace else self.process.poll()
        except subprocess.TimeoutExpired:
            return None
        if code is None:
            return None
        return f"{self.name} exited with code {code}; its log: {self.log} (last line: {last_line(self.log)})"

    # ---- stop ------------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop it and every process it started (its process group): SIGTERM, then SIGKILL after
        :attr:`stop_after` seconds (a server stuck in a call may ignore SIGTERM). Idempotent; what is left of a
        server that exited by itself (its children) is killed."""
        with _RUNNING_LOCK:
            _RUNNING.discard(self)
        process = self.process
        if process is None:
            return
        if process.poll() is not None:
            self._signal(signal.SIGKILL)
            return
        self._signal(signal.SIGTERM)
        try:
            process.wait(self.stop_after)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            process.wait()

    def _signal(self, number: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, number)

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


@atexit.register
def stop_all() -> None:
    """Stop every server this process started and still runs: a last resort, run at exit, for a process that ends
    without its fit's teardown (an error before it, a script that never calls it). A process killed outright is
    covered by ``PR_SET_PDEATHSIG``."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for server in running:
        server.stop()
