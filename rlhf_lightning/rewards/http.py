"""One JSON request to a reward endpoint (a reward server, an OpenAI-compatible judge): a timeout per try, retries
with exponential back-off on what may pass (no connection, a timeout, HTTP 429 and 5xx), said aloud while they last,
and one line naming the endpoint when it does not answer.
"""

from __future__ import annotations

from typing import Any

import httpx

from rlhf_lightning.utils.retrying import GaveUp, RetryPolicy, Transient, keep_trying

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_BACKOFF = 10.0  # seconds between two tries at most: a server back from a restart is found within this


class EndpointError(RuntimeError):
    """An endpoint that did not answer, or answered something other than JSON, after every try; one line."""


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


def request_json(method: str, url: str, payload: dict[str, Any] | None, *, timeout: float, retries: int,
                 backoff: float, headers: dict[str, str] | None, what: str, client: httpx.Client | None,
                 retry_for: float = 0.0) -> Any:
    """One ``method`` request with ``payload`` as its JSON body (None: no body), with :func:`post_json`'s tries,
    said aloud while they last (:func:`~rlhf_lightning.utils.retrying.keep_trying`)."""
    owned = client is None
    client = client or httpx.Client()

    def attempt() -> Any:
        try:
            response = client.request(method, url, json=payload, headers=headers, timeout=timeout)
        except httpx.HTTPError as error:
            raise Transient(_reason(error)) from None
        if response.status_code in RETRY_STATUS:
            raise Transient(f"HTTP {response.status_code}: {_refusal(response)[:200]}")
        if response.status_code >= 400:
            raise EndpointError(f"{what} {url}: HTTP {response.status_code}: {_refusal(response)}")
        try:
            return response.json()
        except ValueError:
            raise EndpointError(f"{what} {url}: the answer is not JSON: {response.text[:200]!r}") from None

    policy = RetryPolicy(retries, retry_for, backoff, MAX_BACKOFF, timeout)
    try:
        return keep_trying(attempt, policy, f"{what} {url}")
    except GaveUp as gave_up:
        tries = f"{gave_up.tries} tr{'y' if gave_up.tries == 1 else 'ies'}"
        if retry_for:
            tries += f" over {gave_up.seconds:.0f}s (retry_for {retry_for:g}s)"
        raise EndpointError(f"{what} {url}: {gave_up.reason} ({tries}, timeout {timeout:g}s each)") from None
    finally:
        if owned:
            client.close()
