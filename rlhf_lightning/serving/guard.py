"""What stands in front of the reward server's routes, so that it can be reached from beyond this machine: an
optional bearer token, a limit on a request's body, and a bound on the requests in the server at once (a busy
server answers 503, which clients retry, instead of queueing without end). A plain ASGI middleware: it reads the
headers only, and counts a body's bytes as they arrive, so an oversized body is never held in memory whole."""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from rlhf_lightning.rewards.remote_protocol import TOKEN_VARIABLE

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Limits:
    """The server's limits on what a client may send.

    Args:
        max_rows: the most completions one ``POST /score`` may carry.
        max_body_bytes: the most bytes one request's body may have.
        max_pending: the most requests in the server at once (read, waiting or scored); more are answered 503.
        token: the bearer token every request must carry (``Authorization: Bearer <token>``); None: none needed.
    """

    max_rows: int = 1024
    max_body_bytes: int = 64 * 2**20
    max_pending: int = 256
    token: str | None = None


DEFAULT_LIMITS = Limits()


class BodyTooLarge(Exception):
    """A request body beyond :attr:`Limits.max_body_bytes`, found while it arrives (no Content-Length, or a false
    one): answered 413."""


def token_from(variable: str) -> str | None:
    """The bearer token in the environment variable ``variable``; None when it is unset or empty."""
    return os.environ.get(variable) or None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


async def answer(send: Send, status: int, error: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """A JSON answer ``{"error": ...}`` with ``status``, sent without the application."""
    body = json.dumps({"error": error}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware applying :class:`Limits` before ``app`` sees a request: 401 without the token, 413 for a
    body beyond the limit (by its Content-Length, or by counting), 503 with ``Retry-After`` when full."""

    def __init__(self, app: App, limits: Limits, token_variable: str = TOKEN_VARIABLE) -> None:
        self.app, self.limits, self.token_variable = app, limits, token_variable
        self.expected = None if limits.token is None else f"Bearer {limits.token}".encode()
        self.pending = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            await answer(send, 401, f"missing or wrong bearer token: send 'Authorization: Bearer <token>' (RemoteReward "
                                    f"sends ${self.token_variable} of its environment)",
                         ((b"www-authenticate", b"Bearer"),))
            return
        length = headers.get(b"content-length")
        if length is not None and not length.isdigit():
            await answer(send, 400, f"Content-Length {length.decode(errors='replace')!r}: expected a number of bytes")
            return
        if length is not None and int(length) > self.limits.max_body_bytes:
            await answer(send, 413, self.too_large(f"{int(length)} bytes"))
            return
        if self.pending >= self.limits.max_pending:
            await answer(send, 503, f"the server holds {self.pending} requests, its max_pending: try again shortly",
                         ((b"retry-after", b"1"),))
            return
        self.pending += 1
        try:
            await self.app(scope, self.counting(receive), send)
        finally:
            self.pending -= 1

    def too_large(self, size: str) -> str:
        return (f"the request's body has {size}, beyond the server's max_body_mb "
                f"({self.limits.max_body_bytes / 2**20:g} MiB): send fewer rows per request (RemoteReward's batch_size)")

    def counting(self, receive: Receive) -> Receive:
        """``receive``, stopping a body at the limit (:class:`BodyTooLarge`, answered 413 by the application)."""
        received = 0

        async def receive_counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limits.max_body_bytes:
                    raise BodyTooLarge(self.too_large(f"more than {self.limits.max_body_bytes} bytes"))
            return message

        return receive_counted
