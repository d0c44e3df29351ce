"""Running the sides: each in a fresh Python process, in alternating rounds, its result one line on stdout.

A benchmark script is both ends: run plainly it is the parent, which calls :func:`run_rounds`; run with
``--child SIDE --settings JSON`` (what :func:`run_child` does) it measures one side in that process and ends with
:func:`report`. So no side inherits another's memory or caches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .measure import GIB, peak_cuda_bytes, peak_rss_bytes, rss_bytes
from .settings import Settings

RESULT_PREFIX = "BENCH_RESULT "


def report(payload: dict[str, Any]) -> None:
    """Hand a child's result to the parent: one line on stdout, with the process's peak memory."""
    payload = {**payload, "peak_rss": peak_rss_bytes(), "peak_cuda": peak_cuda_bytes()}
    print(RESULT_PREFIX + json.dumps(payload), flush=True)


class MemoryLimitExceeded(RuntimeError):
    """A child process grew past the resident memory it was allowed and was killed (see :func:`run_child`)."""

    def __init__(self, side: str, rss: int, limit: int, log: Path) -> None:
        super().__init__(f"{side} was killed at {rss / GIB:.2f} GiB resident, past its limit of "
                         f"{limit / GIB:.2f} GiB; see {log}")
        self.rss, self.limit = rss, limit


def run_child(script: str | Path, side: str, settings: Settings, profile: bool = False, python: str | None = None,
              rss_limit: int | None = None) -> dict[str, Any]:
    """Run one side of a benchmark in a fresh Python process (``script --child side --settings ...``, this
    interpreter or ``python``) and return its result; its output is appended to ``workdir/logs/<side>.log``.

    ``rss_limit``: bytes of resident memory the child may reach; its RSS is polled (5 times a second) and past the
    limit it is killed and :class:`MemoryLimitExceeded` raised, so a side that would not fit never brings the
    machine to the kernel's OOM killer."""
    command = [python or sys.executable, str(Path(script).resolve()), "--child", side, "--settings",
               settings.to_json()]
    if profile:
        command.append("--profile")
    log = Path(settings.workdir) / "logs" / f"{side.replace('/', '_')}.log"
    log.parent.mkdir(exist_ok=True)
    env = dict(os.environ)
    if settings.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(settings.mmap_threshold)
    if rss_limit is None:
        result = subprocess.run(command, capture_output=True, text=True, env=env)
    else:
        result = _run_watched(command, env, side, rss_limit, log)
    with log.open("a") as handle:
        handle.write(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"{side} failed (exit {result.returncode}); see {log}:\n{result.stderr[-3000:]}")
    if profile:
        print(result.stdout.split(RESULT_PREFIX)[0], flush=True)
    line = next(line for line in reversed(result.stdout.splitlines()) if line.startswith(RESULT_PREFIX))
    return json.loads(line[len(RESULT_PREFIX):])


def _run_watched(command: list[str], env: dict[str, str], side: str, rss_limit: int,
                 log: Path) -> subprocess.CompletedProcess:
    """``subprocess.run(command)`` with the child killed once its resident memory passes ``rss_limit``."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    while True:
        try:
            stdout, stderr = process.communicate(timeout=0.2)
            return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
        except subprocess.TimeoutExpired:
            rss = rss_bytes(process.pid)
            if rss > rss_limit:
                process.kill()
                stdout, stderr = process.communicate()
                with log.open("a") as handle:
                    handle.write(stdout + stderr + f"\nKILLED: resident {rss} bytes > limit {rss_limit}\n")
                raise MemoryLimitExceeded(side, rss, rss_limit, log) from None


def run_rounds(script: str | Path, order: Sequence[str], settings: Settings, profile_side: str | None,
               settings_of: Callable[[str], Settings] | None = None, unit: str = "s/iter", digits: int = 2,
               details: Callable[[str, dict[str, Any]], str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """``settings.repeats`` alternating rounds of fresh processes, every side of ``order`` in turn (its settings
    ``settings_of(side)`` where given), ``profile_side`` profiled in the first round; each process's seconds
    per ``unit``, ``details(side, result)`` (which may also check the result) and peak printed as it ends.
    Returns every side's results."""
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in order}
    for round_index in range(settings.repeats):
        for side in order:
            result = run_child(script, side, settings_of(side) if settings_of else settings,
                               side == profile_side and round_index == 0)
            extra = details(side, result) if details else ""
            results[side].append(result)
            seconds = [f"{row['seconds']:.{digits}f}" for row in result["iterations"]]
            print(f"round {round_index + 1}: {side:<22} {unit} {seconds}{extra} peak "
                  f"{result['peak_rss'] / GIB:.3f} GiB", flush=True)
    return results
