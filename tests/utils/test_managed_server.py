"""A server the fit starts, as one managed subprocess (vLLM's and OpenEnv's both): real processes on 127.0.0.1 -- a
tiny HTTP server that answers its health path late, one that exits at start (its log's last line in the error), one
that ignores SIGTERM (killed after ``stop_after``, with the process it started), one whose parent is killed (the
kernel ends it), and one left running at exit (the last-resort stop)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from rlhf_lightning.utils.http import EndpointError, request_json
from rlhf_lightning.utils.managed_server import ManagedServer, free_port, last_line, stop_all
from tests.helpers.cli import REPO

SERVE = """
import http.server, os, signal, subprocess, sys, time
port, delay, ignore_term = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
if ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "300"])  # a process of its own, in its group
    print(f"child {child.pid}", flush=True)
time.sleep(delay)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"status": "healthy"}' if self.path == "/health" else b"no"
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def serving(delay: float = 0.0, ignore_term: bool = False):
    return lambda port: [sys.executable, "-c", SERVE, str(port), str(delay), "1" if ignore_term else "0"]


def gone(pid: int) -> bool:
    """The process ended (a zombie not yet reaped by whoever adopted it counts as ended)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(condition, seconds: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_a_server_is_waited_for_at_its_health_path_and_stopped_when_the_block_ends(tmp_path):
    server = ManagedServer("the test server", tmp_path / "logs" / "server.log", "/health", command=serving(1.0))
    assert server.exited() is None and not server.running
    server.stop()  # not started: nothing to stop
    with server:
        assert server.running and server.url.startswith("http://127.0.0.1:")
        assert request_json("GET", f"{server.url}/health", None, timeout=5) == {"status": "healthy"}
        assert server.start() == server.url  # started once
        pid = server.process.pid
    assert server.process.returncode == -signal.SIGTERM and gone(pid)
    assert "serving" in (tmp_path / "logs" / "server.log").read_text()
    server.stop()  # idempotent
    assert server.exited().startswith("the test server exited with code -15; its log: ")


def test_a_server_that_exits_at_start_is_one_line_with_its_logs_last_line(tmp_path):
    script = ("import sys\nfor i in range(20000): print('loading', i)\nsys.stdout.flush()\n"
              "print('error: no such model: tiny', file=sys.stderr)\nsys.exit(3)")
    log = tmp_path / "server.log"
    server = ManagedServer("the test server", log, command=lambda port: [sys.executable, "-c", script])
    start = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        server.start(60)
    assert time.monotonic() - start < 30  # not the whole startup timeout
    assert str(caught.value) == (f"the test server exited with code 3; its log: {log} (last line: error: no such "
                                 "model: tiny)")
    assert last_line(tmp_path / "missing.log") == "(no log)"
    log.write_text("\n\n")
    assert last_line(log) == "(empty)"


def test_a_server_that_never_answers_is_stopped_after_the_startup_timeout(tmp_path, capsys):
    class Quiet(ManagedServer):
        error = ValueError
        poll_every = 0.2

    server = Quiet("the test server", tmp_path / "server.log", "/health", command=serving(3600), setting="timeout")
    with pytest.raises(ValueError) as caught:
        server.start(1.0)
    assert str(caught.value) == (f"the test server did not answer {server.url}/health within 1 s (timeout); its "
                                 f"log: {tmp_path / 'server.log'}")
    assert server.process.returncode is not None
    assert capsys.readouterr().err.startswith(f"the test server at {server.url} (its log: {tmp_path / 'server.log'}): "
                                              "waiting for it to answer, for up to 1 s (timeout 1 s)")


def test_a_server_that_ignores_sigterm_is_killed_with_what_it_started(tmp_path):
    class Stubborn(ManagedServer):
        stop_after = 1.0

    server = Stubborn("the test server", tmp_path / "server.log", command=serving(ignore_term=True))
    server.start(60)
    assert wait_until(lambda: "child " in (tmp_path / "server.log").read_text())
    child = int((tmp_path / "server.log").read_text().split("child ")[1].split()[0])
    start = time.monotonic()
    server.stop()
    assert 1.0 <= time.monotonic() - start < 10
    assert server.process.returncode == -signal.SIGKILL
    assert wait_until(lambda: gone(child))  # its process group went with it


STARTS_A_SERVER = """
import sys
from rlhf_lightning.utils.managed_server import ManagedServer
server = ManagedServer("the test server", sys.argv[1], command=lambda port: [sys.executable, "-c", sys.argv[2],
                       str(port), "0", "0"])
server.start(60)
print(server.process.pid, flush=True)
sys.stdin.readline()  # the test has seen the server running: now killed (hang) or ended without a stop (exit)
if sys.argv[3] == "hang":
    import time
    time.sleep(300)
"""


@pytest.mark.parametrize("how", ["killed", "exits without stopping it"])
def test_a_server_does_not_outlive_the_process_that_started_it(tmp_path, how):
    """Killed (SIGKILL): the kernel sends the server SIGTERM (``PR_SET_PDEATHSIG``). Ending without a stop: the
    last-resort stop at exit."""
    parent = subprocess.Popen([sys.executable, "-c", STARTS_A_SERVER, str(tmp_path / "server.log"), SERVE,
                               "hang" if how == "killed" else "exit"], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert not gone(pid)
        parent.stdin.write("go\n")
        parent.stdin.flush()
        if how == "killed":
            parent.kill()
        parent.wait(30)
        assert wait_until(lambda: gone(pid)), f"the server {pid} outlived the process that started it"
    finally:
        parent.kill()
        parent.wait()
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_the_last_resort_stops_every_server_still_running(tmp_path):
    servers = [ManagedServer(f"server {k}", tmp_path / f"{k}.log", command=serving()) for k in range(2)]
    for server in servers:
        server.start(60)
    stop_all()
    assert all(server.process.returncode == -signal.SIGTERM for server in servers)
    stop_all()  # nothing left


def test_a_free_port_is_free():
    with pytest.raises(EndpointError, match="connection refused"):
        request_json("GET", f"http://127.0.0.1:{free_port()}/", None, timeout=2)
