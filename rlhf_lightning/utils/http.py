"""The package's one HTTP client: one JSON request to a server (a reward server, a judge endpoint, vLLM's server, an
OpenEnv server's health), a timeout per try, retries with exponential back-off on what may pass (no connection, a
timeout, HTTP 408, 429 and 5xx), said aloud while they last (:mod:`~rlhf_lightning.utils.retrying`), and one line
naming the endpoint when it does not answer. A caller that must not retry passes ``retries=0`` (and no
``retry_for``): its one try fails at once, silently, in its :class:`EndpointError`.
"""

from __future__ import annotations

from typing import Any

import httpx

from rlhf_lightning.utils.retrying import GaveUp, RetryPolicy, Transient, keep_trying

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_BACKOFF = 10.0  # seconds between two tries at most: a server back from a restart is found within this


class EndpointError(RuntimeError):
    """An endpoint that did not answer, or answered something other than JSON, after every try; one line.

    What its last try met, for a caller that words the failure its own way: ``reason`` (the short form the retry
    lines use), ``status`` and ``body`` (the HTTP status and the answer's text, when one came), ``transport`` (the
    connection's or timeout's error, when none came).
    """

    def __init__(self, message: str, reason: str = "", status: int | None = None, body: str = "",
                 transport: httpx.HTTPError | None = None) -> None:
        super().__init__(message)
        self.reason, self.status, self.body, self.transport = reason or message, status, body, transport

    @property
    def timed_out(self) -> bool:
        """No answer came within the timeout."""
        return isinstance(self.transport, httpx.TimeoutException)


def _reason(error: httpx.HTTPError) -> str:
    if isinstance(error, httpx.TimeoutException):
        return f"no answer within the timeout ({type(error).__name__})"
    if isinstance(error, httpx.ConnectError):
        return "connection refused or host unreachable (is the server running?)"
    return f"{type(error).__name__}: {error}"


def _refusal(response: httpx.Response) -> str:
    """What a refusing endpoint said: the ``error`` (or ``detail``) line of a JSON body, else the body's start."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error", body.get("detail")), str):
        return body.get("error", body.get("detail"))
    return response.text[:300].strip()


def post_json(url: str, payload: dict[str, Any], *, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0,
              headers: dict[str, str] | None = None, what: str = "endpoint",
              client: httpx.Client | None = None, retry_for: float = 0.0) -> Any:
    """POST ``payload`` as JSON to ``url`` and return the decoded JSON answer.

    At least ``1 + retries`` tries, and more until ``retry_for`` seconds have passed since the first failure (a
    server restarting: it is waited for), ``timeout`` seconds each, waiting ``backoff * 2**k`` seconds (at most
    :data:`MAX_BACKOFF`) before retry ``k``; only what may pass is retried (no connection, a timeout, HTTP
    408/429/5xx). Anything else (another 4xx, an answer that is not JSON) fails at once. ``what`` names the
    endpoint's role in the error, e.g. ``"RemoteReward"``. The tries are not silent: a ``warning:`` line at the
    first failure (what failed, where, for how long it is tried) and again every 30 s while they last.
    """
    return request_json("POST", url, payload, timeout=timeout, retries=retries, backoff=backoff, headers=headers,
                        what=what, client=client, retry_for=retry_for)


def get_json(url: str, *, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0,
             headers: dict[str, str] | None = None, what: str = "endpoint", client: httpx.Client | None = None,
             retry_for: float = 0.0) -> Any:
    """GET ``url`` and return the decoded JSON answer, tried and refused as :func:`post_json` does."""
    return request_json("GET", url, None, timeout=timeout, retries=retries, backoff=backoff, headers=headers,
                        what=what, client=client, retry_for=retry_for)


def request_json(method: str, url: str, payload: dict[str, Any] | None, *, timeout: float, retries: int = 0,
                 backoff: float = 1.0, headers: dict[str, str] | None = None, what: str = "endpoint",
                 client: httpx.Client | None = None, retry_for: float = 0.0, text: bool = False) -> Any:
    """One ``method`` request with ``payload`` as its JSON body (None: no body), with :func:`post_json`'s tries,
    said aloud while they last (:func:`~rlhf_lightning.utils.retrying.keep_trying`); ``text``: an answer that is
    not JSON is returned as its text (vLLM's adapter loading answers plain text) rather than refused."""
    owned = client is None
    client = client or httpx.Client()
    last: dict[str, Any] = {}  # what the last failed try met, for the caller's own wording

    def attempt() -> Any:
        last.clear()
        try:
            response = client.request(method, url, json=payload, headers=headers, timeout=timeout)
        except httpx.HTTPError as error:
            last["transport"] = error
            raise Transient(_reason(error)) from None
        if response.status_code >= 400:
            last.update(status=response.status_code, body=response.text)
            if response.status_code in RETRY_STATUS:
                raise Transient(f"HTTP {response.status_code}: {_refusal(response)[:200]}")
            reason = f"HTTP {response.status_code}: {_refusal(response)}"
            raise EndpointError(f"{what} {url}: {reason}", reason, **last)
        try:
            return response.json()
        except ValueError:
            if text:
                return response.text
            reason = f"the answer is not JSON: {response.text[:200]!r}"
            raise EndpointError(f"{what} {url}: {reason}", reason, response.status_code, response.text) from None

    policy = RetryPolicy(retries, retry_for, backoff, MAX_BACKOFF, timeout)
    try:
        return keep_trying(attempt, policy, f"{what} {url}")
    except GaveUp as gave_up:
        tries = f"{gave_up.tries} tr{'y' if gave_up.tries == 1 else 'ies'}"
        if retry_for:
            tries += f" over {gave_up.seconds:.0f}s (retry_for {retry_for:g}s)"
        raise EndpointError(f"{what} {url}: {gave_up.reason} ({tries}, timeout {timeout:g}s each)", gave_up.reason,
                            **last) from None
    finally:
        if owned:
            client.close()
