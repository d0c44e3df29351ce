"""What a waiting call prints, and when: the call runs in a thread while the test reads its stderr as it comes, so
a line's time is when a user watching the terminal would have seen it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Waited:
    """The lines a call printed on stderr, each with the seconds from the call's start at which it was seen; the
    call's value or error, and the seconds it took."""

    lines: list[tuple[float, str]] = field(default_factory=list)
    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0

    def texts(self) -> list[str]:
        return [line for _, line in self.lines]


def watch(call: Callable[[], Any], capsys: Any, poll: float = 0.05) -> Waited:
    """Run ``call()`` in a thread and read stderr (pytest's ``capsys``) every ``poll`` seconds until it ends."""
    waited = Waited()
    start = time.monotonic()

    def run() -> None:
        try:
            waited.value = call()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            waited.error = error
        waited.seconds = time.monotonic() - start

    capsys.readouterr()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while True:
        alive = thread.is_alive()
        seen = time.monotonic() - start
        waited.lines += [(seen, line) for line in capsys.readouterr().err.splitlines() if line.strip()]
        if not alive:
            return waited
        time.sleep(poll)
