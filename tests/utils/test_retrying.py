"""No silent wait: every retried remote call (the reward server's client, a judge endpoint, vLLM's server as the fit
starts it) says at its first failure what failed, where and for how long it keeps trying, again while it waits, and
ends in its one-line error when the time is up. Real sockets on 127.0.0.1 throughout: closed ports, servers that
stop, answer late, or answer 429/500."""

from __future__ import annotations

import json
import re
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhf_lightning.rewards.http import EndpointError
from rlhf_lightning.rewards.judge_endpoint import EndpointJudge
from rlhf_lightning.rewards.remote import RemoteReward
from rlhf_lightning.rollout.vllm_process import ServerError, ServerProcess, free_port, request_json
from rlhf_lightning.utils import retrying
from rlhf_lightning.utils.retrying import GaveUp, RetryPolicy, Transient, keep_trying
from tests.helpers.waits import watch

EVERY = 0.5  # seconds between two lines of a wait, in these tests (30 s in a run)
FIRST_WITHIN = 3.0  # "within a few seconds"


@pytest.fixture(autouse=True)
def often(monkeypatch):
    monkeypatch.setattr(retrying, "NOTICE_EVERY", EVERY)


class Handler(BaseHTTPRequestHandler):
    """Answers every request with ``status`` and ``body`` (after ``delay`` seconds), counting the calls."""

    status, body, delay, content_type, calls = 200, b'{"scores": [0.5]}', 0.0, "application/json", 0

    def answer(self) -> None:
        type(self).calls += 1
        if self.headers.get("Content-Length"):
            self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.delay)
        try:
            self.send_response(self.status)
            self.send_header("Content-Type", self.content_type)
            self.send_header("Content-Length", str(len(self.body)))
            self.end_headers()
            self.wfile.write(self.body)
        except OSError:  # the client gave up on a slow answer
            pass

    do_GET = do_POST = answer

    def log_message(self, *args: object) -> None:
        pass


def handler(**attributes: object) -> type[Handler]:
    return type("Answering", (Handler,), {"calls": 0, **attributes})


@contextmanager
def serving(answering: type[Handler]) -> Iterator[tuple[str, ThreadingHTTPServer]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), answering)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()


def assert_a_wait_said_aloud(waited, first: str, retry_for: float) -> None:
    """The first line (at once), a line at least every EVERY seconds while it waited, the error when retry_for
    ended."""
    warnings = [(at, line) for at, line in waited.lines if line.startswith("warning: ")]
    assert warnings, waited.lines
    assert warnings[0][1].startswith(first), warnings[0][1]
    assert warnings[0][0] < FIRST_WITHIN
    times = [at for at, _ in warnings] + [waited.seconds]
    assert max(b - a for a, b in zip(times, times[1:], strict=False)) < EVERY + 1.5, waited.lines
    assert all(" still no answer after " in line for _, line in warnings[1:]), warnings
    assert waited.seconds >= retry_for
    assert isinstance(waited.error, EndpointError)


# ---- the policy's words --------------------------------------------------------------------------------------------

def test_the_lines_say_how_long_the_call_keeps_trying():
    assert RetryPolicy(retry_for=180).how_long() == "for up to 180 s (retry_for 180 s)"
    assert RetryPolicy(retry_for=180).how_long(30.2) == "for up to 150 s more (retry_for 180 s)"
    # without retry_for: the retries, and their back-off (1 + 2 + 4 s) and timeouts (3 x 5 s) at most
    assert RetryPolicy(retries=3, backoff=1.0, timeout=5.0).how_long() == "3 more times (retries), up to 22 s"
    assert RetryPolicy(retry_for=120, setting="").how_long() == "for up to 120 s"
    # the tries retries promises outlast a short retry_for: they are the horizon; then the last try
    assert RetryPolicy(retry_for=3, retries=3).how_long(2.0, 2) == "for up to 6 s more (retry_for 3 s)"
    assert RetryPolicy(retry_for=3, retries=3).how_long(7.0, 4) == "a last time"
    assert RetryPolicy(retries=3, backoff=1.0).how_long(3.0, 4) == "a last time"


def test_a_call_that_answers_after_failing_says_so_and_one_that_never_does_gives_up(capsys):
    failures = iter(["no connection", "HTTP 503: busy"])

    def flaky() -> str:
        reason = next(failures, None)
        if reason:
            raise Transient(reason)
        return "answer"

    policy = RetryPolicy(retries=0, retry_for=5, backoff=0.05)
    assert keep_trying(flaky, policy, "RemoteReward http://h:1/score") == "answer"
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: RemoteReward http://h:1/score: no connection; trying again for up to 5 s (retry_for 5 s)",
                   "RemoteReward http://h:1/score: answered again after 0 s (3 tries)"]

    def down() -> None:
        raise Transient("no connection")

    with pytest.raises(GaveUp) as gave_up:
        keep_trying(down, RetryPolicy(retries=2, backoff=0.01), "judge x at http://h:1/v1")
    assert (gave_up.value.reason, gave_up.value.tries) == ("no connection", 3)
    assert capsys.readouterr().err == ("warning: judge x at http://h:1/v1: no connection; trying again 2 more times "
                                       "(retries), up to 0 s\n")


def test_a_failure_that_cannot_pass_is_not_retried_nor_announced(capsys):
    def refused() -> None:
        raise ValueError("HTTP 422")

    with pytest.raises(ValueError, match="HTTP 422"):
        keep_trying(refused, RetryPolicy(retry_for=30), "RemoteReward http://h:1/score")
    assert capsys.readouterr().err == ""


# ---- the reward server's client ------------------------------------------------------------------------------------

def remote(url: str, timeout: float = 5.0, retry_for: float = 2.0) -> RemoteReward:
    return RemoteReward(url, timeout=timeout, retries=0, backoff=0.1, retry_for=retry_for)


def score(source: RemoteReward) -> object:
    return source.request("/score", {"completions": ["x"]})


def test_a_reward_server_not_running(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    waited = watch(lambda: score(remote(url)), capsys)
    assert_a_wait_said_aloud(waited, f"warning: RemoteReward {url}/score: connection refused or host unreachable "
                                     "(is the server running?); trying again for up to 2 s (retry_for 2 s)", 2.0)
    assert str(waited.error).startswith(f"RemoteReward {url}/score: connection refused")
    assert str(waited.error).endswith("(retry_for 2s), timeout 5s each)")


def test_a_reward_server_killed_mid_run(capsys):
    with serving(handler()) as (url, _):
        source = remote(url)
        assert score(source) == {"scores": [0.5]}  # its connection is kept open: then the server goes
    waited = watch(lambda: score(source), capsys)
    assert_a_wait_said_aloud(waited, f"warning: RemoteReward {url}/score: ", 2.0)
    assert "trying again for up to 2 s (retry_for 2 s)" in waited.texts()[0]


def test_a_reward_server_slower_than_the_timeout(capsys):
    with serving(handler(delay=3.0)) as (url, _):
        waited = watch(lambda: score(remote(url, timeout=0.3, retry_for=1.5)), capsys)
    assert_a_wait_said_aloud(waited, f"warning: RemoteReward {url}/score: no answer within the timeout "
                                     "(ReadTimeout); trying again for up to 2 s (retry_for 1.5 s)", 1.5)
    assert str(waited.error).endswith("(retry_for 1.5s), timeout 0.3s each)")


def test_a_proxy_answering_a_500_page(capsys):
    page = handler(status=500, content_type="text/html", body=b"<html><body>502 Bad Gateway (nginx)</body></html>")
    with serving(page) as (url, _):
        waited = watch(lambda: score(remote(url)), capsys)
    assert_a_wait_said_aloud(waited, f"warning: RemoteReward {url}/score: HTTP 500: <html><body>502 Bad Gateway "
                                     "(nginx)</body></html>; trying again for up to 2 s", 2.0)
    assert page.calls >= 4  # 0.1 + 0.2 + 0.4 + 0.8 s of back-off within the 2 s


def test_a_server_back_within_retry_for_is_said_to_answer_again(capsys):
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def restart() -> None:
        time.sleep(1.0)
        server = ThreadingHTTPServer(("127.0.0.1", port), handler())
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        restarted.append(server)

    restarted: list[ThreadingHTTPServer] = []
    threading.Thread(target=restart, daemon=True).start()
    waited = watch(lambda: score(remote(url, retry_for=30)), capsys)
    for server in restarted:
        server.shutdown()
        server.server_close()
    assert waited.value == {"scores": [0.5]}
    assert waited.texts()[0].startswith(f"warning: RemoteReward {url}/score: connection refused")
    assert re.fullmatch(rf"RemoteReward {url}/score: answered again after [12] s \(\d+ tries\)", waited.texts()[-1])


# ---- a judge endpoint ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["down", "429", "500"])
def test_a_judge_endpoint_down_or_refusing(capsys, case):
    answering = handler(status=int(case) if case != "down" else 200, body=b'{"error": "rate limit"}'
                        if case == "429" else b'{"error": "out of memory"}')
    with serving(answering) as (url, _):
        base_url = f"http://127.0.0.1:{free_port()}/v1" if case == "down" else f"{url}/v1"
        judge = EndpointJudge(base_url, "tiny", None, 4, 0, 8, timeout=5.0, retries=0, backoff=0.1, retry_for=2.0)
        waited = watch(lambda: judge.answers(["a prompt"]), capsys)
    reason = {"down": "connection refused or host unreachable (is the server running?)",
              "429": "HTTP 429: rate limit", "500": "HTTP 500: out of memory"}[case]
    assert_a_wait_said_aloud(waited, f"warning: judge tiny at {base_url}/completions: {reason}; trying again for up "
                                     "to 2 s (retry_for 2 s)", 2.0)
    assert str(waited.error).startswith(f"judge tiny at {base_url}/completions: {reason} (")


# ---- vLLM's server, as the fit starts it ---------------------------------------------------------------------------

class LateServer(ServerProcess):
    """A stand-in for vLLM's server process with its wait: a real HTTP server that answers ``/v1/models`` once
    ``after`` seconds have passed (None: never)."""

    def __init__(self, log, after: float | None) -> None:  # noqa: ANN001
        super().__init__(log, [], on_cpu=True)
        self.after = after

    def command(self, port: int) -> list[str]:
        script = textwrap.dedent(f"""
            import http.server, json, time
            time.sleep({self.after if self.after is not None else 3600})
            class Models(http.server.BaseHTTPRequestHandler):
                def do_GET(self):
                    body = json.dumps({{"data": []}}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
            http.server.HTTPServer(("127.0.0.1", {port}), Models).serve_forever()
        """)
        return [sys.executable, "-c", script]


def test_a_vllm_server_the_fit_starts_is_waited_for_aloud(capsys, tmp_path):
    server = LateServer(tmp_path / "server.log", after=1.5)
    try:
        waited = watch(lambda: server.start(30.0), capsys)
    finally:
        server.stop()
    assert waited.error is None and waited.value.startswith("http://127.0.0.1:")
    first_at, first = waited.lines[0]
    assert first == (f"the vLLM server the fit started at {waited.value} (its log: {tmp_path / 'server.log'}): "
                     "waiting for it to answer, for up to 30 s (engine.init_args.startup_timeout 30 s)")
    assert first_at < FIRST_WITHIN
    assert any(line.startswith(f"the vLLM server the fit started at {waited.value} (its log: ")
               and ": still no answer after 1 s (connection refused or host unreachable " in line
               for line in waited.texts()), waited.texts()


def test_a_vllm_server_that_never_answers_ends_in_its_line(capsys, tmp_path):
    server = LateServer(tmp_path / "server.log", after=None)
    waited = watch(lambda: server.start(1.5), capsys)
    assert isinstance(waited.error, ServerError) and waited.seconds >= 1.5
    assert str(waited.error) == (f"the vLLM server the fit started did not answer {server.url}/v1/models within "
                                 f"1.5 s (engine.init_args.startup_timeout); its log: {tmp_path / 'server.log'}")
    assert server.process.poll() is not None  # stopped
    assert waited.texts()[0].endswith("waiting for it to answer, for up to 2 s (engine.init_args.startup_timeout "
                                      "1.5 s)")


@pytest.mark.parametrize("case", ["down", "503", "404", "text", "slow"])
def test_a_call_to_a_vllm_server_is_tried_once_in_its_own_words(capsys, case):
    """vLLM's calls go through the one HTTP client with no retries: each failure is its one line at once, silently;
    an answer that is not JSON (an adapter loaded) is its text."""
    answering = handler(status={"503": 503, "404": 404}.get(case, 200), delay=2.0 if case == "slow" else 0.0,
                        content_type="text/plain", body=b"Success: LoRA adapter added" if case == "text"
                        else b"The model `policy-v3`\ndoes not exist.")
    with serving(answering) as (url, _):
        url = f"http://127.0.0.1:{free_port()}" if case == "down" else url
        try:
            answer, error = request_json("POST", f"{url}/v1/load_lora_adapter", {"lora_name": "x"}, 1.0), None
        except ServerError as failure:
            answer, error = None, failure
    expected = {
        "down": (f"^cannot reach the vLLM server: POST {url}/v1/load_lora_adapter: \\[Errno 111\\] Connection refused$", None),
        "503": (f"^the vLLM server answered 503 to POST {url}/v1/load_lora_adapter: The model `policy-v3` does not "
                "exist.$", 503),
        "404": (f"^the vLLM server answered 404 to POST {url}/v1/load_lora_adapter: The model", 404),
        "slow": (f"^the vLLM server did not answer POST {url}/v1/load_lora_adapter within 1 s "
                 "\\(engine.init_args.request_timeout\\)$", None)}
    if case == "text":
        assert answer == "Success: LoRA adapter added" and error is None
    else:
        pattern, status = expected[case]
        assert re.match(pattern, str(error)), str(error)
        assert error.status == status
    assert answering.calls == (0 if case == "down" else 1) and capsys.readouterr().err == ""


def test_the_judge_payload_is_json(capsys):
    """The requests retried are the ones a judge sends: its model, temperature 0 and seed travel in each."""
    seen: list[dict] = []

    class Recording(Handler):
        def do_POST(self) -> None:
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            body = b'{"choices": [{"index": 0, "text": " yes"}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serving(Recording) as (url, _):
        judge = EndpointJudge(f"{url}/v1", "tiny", None, 4, 7, 8, timeout=5.0, retries=0, backoff=0.1, retry_for=2)
        assert judge.answers(["p"]) == [" yes"]
    assert seen == [{"model": "tiny", "temperature": 0, "seed": 7, "prompt": "p", "max_tokens": 4}]
    assert capsys.readouterr().err == ""


def test_a_call_without_retries_fails_with_its_line_alone(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EndpointError, match=r"\(1 try, timeout 5s each\)$"):
        RemoteReward(url, timeout=5.0, retries=0, retry_for=0).request("/info")
    assert capsys.readouterr().err == ""
