"""Retrying a remote call aloud: one policy (tries, for how long, the back-off) and one loop that every client of a
remote service shares (the reward server's, a judge endpoint's, OpenEnv's, vLLM's server).

A wait is never silent: at the first failure one line says what failed, at which address, and how long the call
keeps trying; while it waits a line again at least every :data:`NOTICE_EVERY` seconds (a thread of its own, so a
try blocked in its timeout does not hold the line back); a call that answers after a failure says so; one that
never answers ends in the caller's own one-line error (:class:`GaveUp` carries what it needs).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
NOTICE_EVERY = 30.0  # seconds between two lines of one wait at most


class Transient(Exception):
    """A failure that may pass (no connection, a timeout, HTTP 429 or 5xx, a server still starting): tried again.
    ``reason`` is what the lines say of it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GaveUp(Exception):
    """Every try failed: the last ``reason``, the number of ``tries`` and the ``seconds`` since the first failure."""

    def __init__(self, reason: str, tries: int, seconds: float) -> None:
        super().__init__(reason)
        self.reason, self.tries, self.seconds = reason, tries, seconds


@dataclass(frozen=True)
class RetryPolicy:
    """How a remote call is tried again.

    Args:
        retries: tries after the first, at least.
        retry_for: and more tries until this many seconds have passed since the first failure (0: ``retries``).
        backoff: seconds before the first retry, doubled before each next one, up to ``max_backoff``.
        max_backoff: seconds between two tries at most.
        timeout: seconds one try may take (to say how long the tries take when ``retry_for`` is 0).
        setting: the setting the lines name for how long (``retry_for``, ``engine.init_args.startup_timeout``);
            empty: none names it.
    """

    retries: int = 3
    retry_for: float = 0.0
    backoff: float = 1.0
    max_backoff: float = 10.0
    timeout: float = 0.0
    setting: str = "retry_for"

    def delay(self, retry: int) -> float:
        """Seconds before retry ``retry`` (0 for the first)."""
        return min(self.backoff * 2 ** retry, self.max_backoff)

    def goes_on(self, tries: int, failing_for: float) -> bool:
        """Whether a call that failed ``tries`` times, the first ``failing_for`` seconds ago, is tried again."""
        return tries <= self.retries or failing_for < self.retry_for

    def how_long(self, failing_for: float = 0.0, tries: int = 1) -> str:
        """How long a call that failed ``tries`` times, the first ``failing_for`` seconds ago, keeps trying:
        ``for up to 150 s more (retry_for 180 s)``, ``3 more times (retries), up to 22 s``; ``a last time``.
        The tries ``retries`` promises count too when their back-off outlasts ``retry_for``."""
        retries_left = max(self.retries + 1 - tries, 0)
        waits = sum(self.delay(k) for k in range(tries - 1, self.retries))  # the back-off before those tries
        if self.retry_for:
            left = max(self.retry_for - failing_for, waits)
            if failing_for and left < 0.5:
                return "a last time"
            more = " more" if failing_for else ""
            named = f" ({self.setting} {self.retry_for:g} s)" if self.setting else ""
            return f"for up to {left:.0f} s{more}{named}"
        if not retries_left:
            return "a last time"
        span = waits + retries_left * self.timeout
        return f"{retries_left} more time{'s' if retries_left != 1 else ''} (retries), up to {span:.0f} s"


def _say(line: str) -> None:
    sys.stderr.write(f"{line}\n")  # one write: ranks printing at the same moment do not cut into each other's line
    sys.stderr.flush()


class _Notice:
    """The lines of one wait: the first failure, then every ``every`` seconds from a thread while it lasts."""

    def __init__(self, subject: str, policy: RetryPolicy, waiting: bool, every: float) -> None:
        self.subject, self.policy, self.waiting, self.every = subject, policy, waiting, every
        self.reason, self.first, self.tries = "", 0.0, 0
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def failed(self, reason: str, first: float, tries: int) -> None:
        self.reason, self.tries = reason, tries
        if self.thread is not None:
            return
        self.first = first
        if self.waiting:  # a server starting: not answering yet is expected, and not a warning
            _say(f"{self.subject}: waiting for it to answer, {self.policy.how_long()}")
        else:
            _say(f"warning: {self.subject}: {reason}; trying again {self.policy.how_long()}")
        self.thread = threading.Thread(target=self._repeat, daemon=True, name="retry-notice")
        self.thread.start()

    def _repeat(self) -> None:
        while not self.stop.wait(self.every):
            failing_for = time.monotonic() - self.first
            warning = "" if self.waiting else "warning: "
            _say(f"{warning}{self.subject}: still no answer after {failing_for:.0f} s ({self.reason}); trying "
                 f"again {self.policy.how_long(failing_for, self.tries)}")

    def end(self, tries: int, answered: bool) -> None:
        if self.thread is None:
            return
        self.stop.set()
        self.thread.join()
        if answered and not self.waiting:
            _say(f"{self.subject}: answered again after {time.monotonic() - self.first:.0f} s ({tries} tries)")


def keep_trying(attempt: Callable[[], T], policy: RetryPolicy, subject: str, waiting: bool = False,
                every: float | None = None) -> T:
    """``attempt()``'s value, tried again by ``policy`` while it raises :class:`Transient` (anything else goes
    through at once); :class:`GaveUp` when the policy's tries are spent. ``subject`` names the call in the lines
    (``RemoteReward http://host:8000/score``); ``waiting``: a server that is starting, whose first failures are
    expected (its lines are not warnings); ``every``: seconds between two lines (:data:`NOTICE_EVERY`)."""
    notice = _Notice(subject, policy, waiting, NOTICE_EVERY if every is None else every)
    tries, answered, first = 0, False, None
    try:
        while True:
            if tries:
                time.sleep(policy.delay(tries - 1))
            tries += 1
            try:
                value = attempt()
            except Transient as failure:
                first = first or time.monotonic()
                if not policy.goes_on(tries, time.monotonic() - first):  # a call never retried says nothing more
                    raise GaveUp(failure.reason, tries, time.monotonic() - first) from None
                notice.failed(failure.reason, first, tries)
                continue
            answered = True
            return value
    finally:
        notice.end(tries, answered)
