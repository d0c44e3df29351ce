"""When one rank of a distributed run fails or disappears, every rank says which and why in one line.

Without this, the rank that raised prints its error and exits, and every other rank, blocked in a collective with
it, dies seconds later with gloo's (or NCCL's) "Connection closed by peer ... Check the logs of the remote worker"
and an 80-line traceback that buries the real error above it.

The mechanism is a file per rank in the run folder, ``<run folder>/rank-errors/rank-<N>.json``, since the run
folder is where every rank already agrees to write (checkpoints, exports) and it outlives any process; a store key
would die with the process that hosts the store (rank 0, under Lightning's launcher and SLURM).

- A rank whose run raises writes ``{"rank": N, "error": "ValueError: ..."}`` *before* it exits, so before its
  sockets close and the other ranks' collectives fail; then it prints its error as one process would (one line for
  an error of ours, the traceback for any other).
- A rank whose collective fails writes ``{"rank": N, "error": null}`` (it is alive), waits up to
  :data:`WAIT_SECONDS` for the other ranks' files, and stops with one line: ``rank 1 failed: ValueError: ...``
  for each rank that wrote an error; else, where this process started the others (rank 0 under Lightning's own
  launcher), how they ended (``rank 1 was killed by SIGKILL, without an error report``); else the ranks that wrote
  nothing at all (killed by ``kill -9`` or the out-of-memory killer, or their machine lost; or on a machine that
  does not share the run folder): ``rank 1 is gone without an error report ...``.

Files older than the reading rank's start are a previous run's and are ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlhf_lightning.cli.errors import error_message, user_error, want_traceback

WAIT_SECONDS = 2.0  # for the other ranks' files: a shared file system may show them late
POLL_SECONDS = 0.1
FOLDER = "rank-errors"
# A collective that failed because a peer went away: gloo's and NCCL's messages (raised as RuntimeError or
# torch.distributed.DistError), with the source location and the advice cut off for the line.
COLLECTIVE_FAILURE = re.compile(r"gloo|NCCL|Connection (closed|reset) by peer|Broken pipe|Socket ?Timeout", re.I)
SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*")


class RankFailure(RuntimeError):
    """Another rank of this distributed run failed or disappeared (the message says which, and its error)."""


def report_folder(run_folder: str | Path) -> Path:
    """Where the ranks of a run leave their reports: ``<run folder>/rank-errors``."""
    return Path(run_folder) / FOLDER


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` (or an error in its chain) is a collective that failed because a peer went away."""
    from torch.distributed import DistError

    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, DistError) or (isinstance(current, RuntimeError)
                                              and COLLECTIVE_FAILURE.search(str(current))):
            return True
        current = current.__cause__ or current.__context__
    return False


def failure_text(error: BaseException) -> str:
    """``ValueError: <message>``: the error a failed rank reports. An error of ours is its one-line message; any
    other error's traceback is printed by its own rank (said here), or by every rank with the traceback setting."""
    ours = user_error(error)
    if ours is not None and not want_traceback():
        return f"{type(ours).__name__}: {error_message(ours)}"
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line} (its traceback is in that rank's output)"


def collective_text(error: BaseException) -> str:
    """The first sentence of a failed collective's message, without gloo's source location."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return SOURCE_LOCATION.sub("", first_line).split(". ")[0].rstrip(".")


def write_report(folder: Path, rank: int, error: str | None) -> None:
    """Leave this rank's report (``error`` None: alive, its collective failed). A folder that cannot be written
    loses the report, not the error: the rank still prints its own line."""
    path = folder / f"rank-{rank}.json"
    temp = path.with_suffix(".tmp")  # renamed into place: a reader never sees half a report
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        temp.write_text(json.dumps({"rank": rank, "error": error}))
        os.replace(temp, path)


def read_reports(folder: Path, since: float) -> dict[int, str | None]:
    """Rank -> its error (None: alive) of the reports written at or after ``since`` (earlier ones are another
    run's)."""
    reports: dict[int, str | None] = {}
    for path in folder.glob("rank-*.json") if folder.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            if path.stat().st_mtime >= since:
                report: dict[str, Any] = json.loads(path.read_text())
                reports[int(report["rank"])] = report["error"]
    return reports


def launched_exit_codes(trainer: Any) -> dict[int, int | None]:
    """Rank -> exit status (None: running; negative: the signal that killed it) of the ranks that Lightning's own
    launcher started from this process (rank 0 of a machine, without torchrun or SLURM); empty elsewhere."""
    processes = getattr(trainer.strategy.launcher, "procs", None) or []
    first = trainer.node_rank * trainer.num_devices + 1
    return {first + index: process.poll() for index, process in enumerate(processes)}


def how_it_ended(rank: int, status: int) -> str:
    """``rank 1 was killed by SIGKILL`` or ``rank 1 exited with status 3``."""
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"rank {rank} was killed by {signal.Signals(-status).name}"
    return f"rank {rank} exited with status {status}"


def peer_failure_line(reports: dict[int, str | None], exits: dict[int, int | None], rank: int, world_size: int,
                      collective: str) -> str:
    """The line a rank whose collective failed prints: the ranks that failed and their errors; else those known to
    have ended (``exits``); else the ranks that left no report."""
    failed = {other: error for other, error in sorted(reports.items()) if other != rank and error is not None}
    if failed:
        return "; ".join(f"rank {other} failed: {error}" for other, error in failed.items())
    ended = [how_it_ended(other, status) for other, status in sorted(exits.items()) if status is not None]
    if ended:
        return f"{'; '.join(ended)}, without an error report"
    gone = [other for other in range(world_size) if other != rank and other not in reports and other not in exits]
    if not gone:
        return f"a collective failed and no rank reported an error: {collective}"
    ranks = f"rank {gone[0]} is" if len(gone) == 1 else f"ranks {', '.join(map(str, gone))} are"
    return (f"{ranks} gone without an error report (killed, e.g. by kill -9 or the out-of-memory killer, or the "
            f"machine lost); this rank's collective failed: {collective}")


def wait_for_peers(trainer: Any, since: float) -> tuple[dict[int, str | None], dict[int, int | None]]:
    """The other ranks' reports and, where this process launched them, exit statuses: as soon as one rank reported
    an error, one is known to have ended or every rank has reported; else what is known after
    :data:`WAIT_SECONDS`."""
    folder, rank, world_size = report_folder(trainer.default_root_dir), trainer.global_rank, trainer.world_size
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        reports = {other: error for other, error in read_reports(folder, since).items() if other != rank}
        exits = launched_exit_codes(trainer)
        if (any(error is not None for error in reports.values()) or any(s is not None for s in exits.values())
                or len(reports) >= world_size - 1 or time.monotonic() >= deadline):
            return reports, exits
        time.sleep(POLL_SECONDS)


@contextlib.contextmanager
def rank_failures_reported(trainer: Any) -> Iterator[None]:
    """Around a run of ``trainer``: on more than one rank, an error is reported to the other ranks, and a
    collective that fails because another rank went away becomes a :class:`RankFailure` naming that rank and its
    error (one line, through the command line's error handling: exit status 1)."""
    since = time.time() - 1.0  # a file's time can lag the clock by a tick; an earlier run ended before this began
    try:
        yield
    except Exception as error:
        if trainer.world_size < 2:
            raise
        folder, rank = report_folder(trainer.default_root_dir), trainer.global_rank
        if not is_collective_failure(error):
            write_report(folder, rank, failure_text(error))
            raise
        write_report(folder, rank, None)
        reports, exits = wait_for_peers(trainer, since)
        line = peer_failure_line(reports, exits, rank, trainer.world_size, collective_text(error))
        raise RankFailure(line) from error
