"""One JSON request to a reward endpoint: a server that restarts within ``retry_for`` is waited for (the request
succeeds), one that stays away ends in one line saying how long it was tried, and a client's mistake (a 4xx) is
never retried."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhf_lightning.rewards.http import EndpointError, post_json


class Answer(BaseHTTPRequestHandler):
    """Answers every POST with ``status`` and ``{"ok": true}`` (or an error line), counting the calls."""

    status = 200
    calls = 0

    def do_POST(self) -> None:
        type(self).calls += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"ok": True} if self.status == 200 else {"error": "bad request"}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def serving(port: int, handler: type[BaseHTTPRequestHandler], after: float = 0.0) -> Iterator[None]:
    """``handler`` on ``port``, started ``after`` seconds from now (a server coming back from a restart)."""
    servers: list[ThreadingHTTPServer] = []

    def start() -> None:
        time.sleep(after)
        server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        servers.append(server)
        server.serve_forever(0.05)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    try:
        yield
    finally:
        while not servers and thread.is_alive():
            time.sleep(0.05)
        for server in servers:
            server.shutdown()
            server.server_close()


def test_a_server_back_within_retry_for_is_waited_for():
    port = free_port()
    with serving(port, type("Restarted", (Answer,), {}), after=1.5):  # down for 1.5 s, as during a restart
        answer = post_json(f"http://127.0.0.1:{port}/score", {}, retries=0, backoff=0.1, timeout=5, retry_for=30)
    assert answer == {"ok": True}


def test_a_server_that_stays_away_ends_in_one_line_with_the_time_tried():
    port = free_port()
    with pytest.raises(EndpointError) as error:
        post_json(f"http://127.0.0.1:{port}/score", {}, retries=1, backoff=0.1, timeout=5, what="RemoteReward",
                  retry_for=1.0)
    message = str(error.value)
    assert message.startswith(f"RemoteReward http://127.0.0.1:{port}/score: connection refused or host unreachable "
                              "(is the server running?) (")
    assert message.endswith(" (retry_for 1s), timeout 5s each)")
    tries = int(message.rsplit("(", 2)[1].split()[0])
    assert tries >= 4  # 0.1 + 0.2 + 0.4 + 0.8 s of back-off before a second had passed: more than 1 + retries


def test_a_clients_mistake_is_not_retried():
    port = free_port()
    handler = type("Refusing", (Answer,), {"status": 422, "calls": 0})
    with serving(port, handler), pytest.raises(EndpointError) as error:
        time.sleep(0.2)
        post_json(f"http://127.0.0.1:{port}/score", {}, retries=3, backoff=0.1, timeout=5, retry_for=30)
    assert str(error.value) == f"endpoint http://127.0.0.1:{port}/score: HTTP 422: bad request"
    assert handler.calls == 1
