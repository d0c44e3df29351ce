"""The real reward server (``python -m rlhf_lightning serve-reward``) in a subprocess on a free loopback port, as
the server tests start it: from a config file as a user writes one, stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import yaml

from tests.helpers.environment import REPO, with_repo_on_path

SERVED_CLASS = "tests.helpers.served_sources.NaNOnMarker"
LABEL = f"reward_model ({SERVED_CLASS})"


@dataclass
class Started:
    """A running server: its address, the ready line it printed, and (after it stopped) its output."""

    url: str
    ready: str
    stdout: str = ""
    stderr: str = ""


def start(folder: Path, model_dir: Path, reward_dir: Path, **settings: Any) -> tuple[subprocess.Popen, Started]:
    """The server of :data:`SERVED_CLASS` on ``model_dir`` and ``reward_dir`` with ``settings`` (serve-reward's
    arguments; ``env`` is the process's extra environment), once it printed its ready line."""
    env = settings.pop("env", {})
    config = folder / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "base": {"name_or_path": str(model_dir)},
        "reward": {"class_path": SERVED_CLASS, "init_args": {"path": str(reward_dir)}},
        "port": 0, **settings}))
    process = subprocess.Popen([sys.executable, "-m", "rlhf_lightning", "serve-reward", "--config", str(config)],
                               cwd=REPO, env=with_repo_on_path(**env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    ready = process.stdout.readline()
    if not ready.startswith(f"serving {LABEL} at http://127.0.0.1:"):
        process.kill()
        pytest.fail(f"no ready line: {ready!r}\n{process.communicate()[1][-3000:]}")
    return process, Started(ready.split(" at ", 1)[1].split()[0], ready.strip())


@contextmanager
def reward_server(folder: Path, model_dir: Path, reward_dir: Path, **settings: Any) -> Iterator[Started]:
    """:func:`start`'s server for the block; its output is read once it stopped (SIGTERM), which must end it
    cleanly."""
    process, started = start(folder, model_dir, reward_dir, **settings)
    try:
        yield started
    finally:
        process.send_signal(signal.SIGTERM)
        started.stdout, started.stderr = process.communicate(timeout=60)
        assert process.returncode == 0, started.stderr[-3000:]
        assert started.stdout.startswith(f"stopped serving {LABEL} (SIGTERM; served "), started.stdout


class StopServerAt(L.Callback):
    """Kills the process ``pid`` (a reward server) with SIGKILL at the end of training iteration ``iteration``, as
    a crashed or stopped server would go away mid-run.

    Args:
        pid: the server's process id.
        iteration: the iteration (1-based) after which it goes away.
    """

    def __init__(self, pid: int, iteration: int) -> None:
        self.pid, self.iteration = pid, iteration

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.fit_loop.epoch_loop.total_batch_idx + 1 == self.iteration:
            os.kill(self.pid, signal.SIGKILL)
            wait_until_exited(self.pid)


def wait_until_exited(pid: int, timeout: float = 30.0) -> None:
    """Wait until every thread of process ``pid`` has exited (gone, or a zombie its parent has not reaped): its
    sockets are closed then. Until the last thread is out, its listening socket still takes connections and resets
    them, which the next iteration's request met under load instead of a refused connection; the main thread alone
    is not enough (it can be a zombie while the others still hold the files)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(state in ("Z", "X") for state in thread_states(pid)):
            return
        time.sleep(0.05)
    raise TimeoutError(f"process {pid} was sent SIGKILL and had not exited {timeout:.0f} s later")


def thread_states(pid: int) -> list[str]:
    """The state letter of each thread of process ``pid`` still listed (none once it is gone)."""
    states = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return states
    for task in tasks:
        try:  # /proc/PID/task/TID/stat: "TID (COMMAND) STATE ..."; the command may hold spaces and parentheses
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # that thread is gone
    return states
