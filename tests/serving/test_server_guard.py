"""The reward server as a service that can be exposed: a bearer token (401 without it, RemoteReward sends its
environment's), body and row limits (413/422 before a body is held whole), a bound on requests in flight (503,
which clients retry), FastAPI's pages off unless asked for, no machine path or exception text in an answer, and a
warning when it listens beyond loopback without a token."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import httpx
import pytest
import torch

from rlhf_lightning import RemoteReward
from rlhf_lightning.cli import main
from rlhf_lightning.models.loading import load_tokenizer
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.rewards.http import EndpointError
from rlhf_lightning.rewards.remote_protocol import TOKEN_VARIABLE
from rlhf_lightning.serving.guard import Guard, Limits, is_loopback
from tests.helpers.reward_server import Started, reward_server
from tests.helpers.served_sources import CRASH_MARKER, SECRET_PATH

TOKEN = "s3cret-token"
BODY_LIMIT = 4096  # bytes: serve-reward's max_body_mb below


@pytest.fixture(scope="module")
def guarded(tiny_model_dir, reward_dir, tmp_path_factory) -> Iterator[Started]:
    """A server that needs :data:`TOKEN`, takes bodies up to :data:`BODY_LIMIT` bytes and serves its docs."""
    with reward_server(tmp_path_factory.mktemp("guarded"), tiny_model_dir, reward_dir, docs=True,
                       max_body_mb=BODY_LIMIT / 2**20, env={TOKEN_VARIABLE: TOKEN}) as started:
        yield started
    # The crash below: its traceback in the server's log under the id its answer gave, and nowhere else.
    assert "RuntimeError: cannot read /srv/secret/reward-model/weights.bin" in started.stderr
    assert "reward server error " in started.stderr


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(BaseModelSpec(name_or_path=str(tiny_model_dir)))


def authorised(**headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}", **headers}


def test_the_ready_line_says_a_token_is_needed(guarded):
    assert guarded.ready.endswith(f" (bearer token: ${TOKEN_VARIABLE})")


def test_a_request_without_the_token_is_a_401_that_remote_reward_does_not_retry(guarded, tokenizer, monkeypatch):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        response = httpx.get(f"{guarded.url}/info", headers=headers)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert response.json() == {"error": "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                                            f"(RemoteReward sends ${TOKEN_VARIABLE} of its environment)"}
    monkeypatch.delenv(TOKEN_VARIABLE, raising=False)
    with pytest.raises(EndpointError) as error:
        RemoteReward(guarded.url, retries=3, backoff=30.0).setup(None, tokenizer)  # a retry would take 30 s
    assert str(error.value).startswith(f"RemoteReward {guarded.url}/info: HTTP 401: missing or wrong bearer token")


def test_remote_reward_sends_the_token_of_its_environment(guarded, tokenizer, monkeypatch):
    monkeypatch.setenv(TOKEN_VARIABLE, TOKEN)
    remote = RemoteReward(guarded.url)
    remote.setup(None, tokenizer)
    body = {"prompts": ["a b"], "completions": ["c"]}
    expected = httpx.post(f"{guarded.url}/score", json=body, headers=authorised()).json()["scores"]
    from rlhf_lightning.rewards.inputs import reward_inputs

    ids = torch.tensor([tokenizer("a b")["input_ids"] + tokenizer("c", add_special_tokens=False)["input_ids"]
                        + [tokenizer.eos_token_id]])
    response_mask = torch.zeros_like(ids)
    response_mask[0, -2:] = 1
    inputs = reward_inputs(ids, torch.ones_like(ids), response_mask, ["c"], ["a b"], None, tokenizer)
    torch.testing.assert_close(remote.score(inputs), torch.tensor(expected), rtol=0, atol=1e-5)


def test_a_body_beyond_the_limit_is_a_413_before_it_is_read_whole(guarded):
    big = json.dumps({"prompts": ["a"] * 1000, "completions": ["b"] * 1000}).encode()
    assert len(big) > BODY_LIMIT
    expected = "the request's body has {}, beyond the server's max_body_mb (0.00390625 MiB): send fewer rows per " \
               "request (RemoteReward's batch_size)"
    response = httpx.post(f"{guarded.url}/score", content=big, headers=authorised())  # by its Content-Length
    assert (response.status_code, response.json()) == (413, {"error": expected.format(f"{len(big)} bytes")})

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for start in range(0, len(big), 1024):
            yield big[start:start + 1024]

    response = httpx.post(f"{guarded.url}/score", content=chunks(), headers=authorised())
    assert response.status_code == 413
    assert response.json() == {"error": expected.format(f"more than {BODY_LIMIT} bytes")}


def test_a_crash_answers_an_id_without_internals(guarded):
    response = httpx.post(f"{guarded.url}/score", json={"prompts": ["a"], "completions": [CRASH_MARKER]},
                          headers=authorised())
    assert response.status_code == 500
    error = response.json()["error"]
    assert error.startswith("the reward server failed on this request (error ") and error.endswith(
        ": its traceback is in the server's log)")
    assert SECRET_PATH not in error and "RuntimeError" not in error


def test_docs_are_served_when_asked_for_and_behind_the_token(guarded):
    assert httpx.get(f"{guarded.url}/openapi.json").status_code == 401
    assert httpx.get(f"{guarded.url}/openapi.json", headers=authorised()).status_code == 200
    assert httpx.get(f"{guarded.url}/docs", headers=authorised()).status_code == 200


@pytest.mark.slow  # a server of its own in a subprocess
def test_the_default_server_serves_no_docs(tiny_model_dir, reward_dir, tmp_path):
    with reward_server(tmp_path, tiny_model_dir, reward_dir) as started:
        for page in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(f"{started.url}{page}").status_code == 404, page
        assert httpx.get(f"{started.url}/info").status_code == 200  # no token set: none needed


def test_requests_beyond_max_pending_are_a_503_to_retry():
    """Two requests in flight with max_pending 1: the second is answered 503 with Retry-After, the first goes on."""
    async def scenario() -> list[tuple[int, str | None]]:
        release = asyncio.Event()

        async def slow_app(scope, receive, send) -> None:
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        guard = Guard(slow_app, Limits(max_pending=1))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://server") as client:
            first = asyncio.create_task(client.get("/info"))
            while guard.pending == 0:
                await asyncio.sleep(0.01)
            second = await client.get("/info")
            release.set()
            answers = [await first, second]
        assert guard.pending == 0
        return [(answer.status_code, answer.headers.get("retry-after")) for answer in answers]

    assert asyncio.run(scenario()) == [(200, None), (503, "1")]


def test_listening_beyond_loopback_without_a_token_warns(tiny_model_dir, reward_dir, capsys, monkeypatch):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("gpu-node-7")
    monkeypatch.delenv(TOKEN_VARIABLE, raising=False)
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with taken, pytest.raises(SystemExit):  # the port is taken: it stops right after the warning
        main(["serve-reward", f"--base.name_or_path={tiny_model_dir}", "--reward",
              f"{{class_path: rlhf_lightning.AdapterReward, init_args: {{path: {reward_dir}}}}}",
              "--host", "0.0.0.0", "--port", str(port)])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: serve-reward listens on 0.0.0.0 with no token: anyone who reaches port {port} "
                        f"can use it (set ${TOKEN_VARIABLE} on the server and its clients to require one)"]
