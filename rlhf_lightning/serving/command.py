"""``python -m rlhf_lightning serve-reward``: load a base and a reward source once, as an online module's ``base:``
and ``reward:`` arguments name them, and serve them over HTTP until Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from jsonargparse import ActionConfigFile, ArgumentParser

from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer, position_limit
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.rewards.sources import RewardSource
from rlhf_lightning.serving.guard import DEFAULT_LIMITS, TOKEN_VARIABLE, Limits, is_loopback, token_from
from rlhf_lightning.serving.scoring import RewardService
from rlhf_lightning.utils import checks

INSTALL_HINT = "pip install -e '.[serve]' (in the repository's clone)"


def require_serving() -> None:
    """FastAPI and uvicorn (the ``serve`` extra) must be installed: one line saying how, else."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise RuntimeError(f"serve-reward needs fastapi and uvicorn ({error}): {INSTALL_HINT}") from error


def serve_reward(base: BaseModelSpec, reward: RewardSource, host: str = "127.0.0.1", port: int = 8000,
                 max_batch_size: int = 64, max_wait_ms: float = 10.0, device: str = "auto", max_rows: int = 1024,
                 max_body_mb: float = 64.0, max_pending: int = 256, token_variable: str = TOKEN_VARIABLE,
                 docs: bool = False) -> None:
    """Serve a reward source over HTTP: ``GET /info``, ``POST /score`` (docs/reward-server.md); train through it
    with ``reward: {class_path: rlhf_lightning.RemoteReward, init_args: {url: http://HOST:PORT}}``.

    Args:
        base: the base model, as an online module's ``base`` (e.g. ``{name_or_path: outputs/sft/model}``): the
            model a reward adapter was trained on. Its tokenizer gives requests' token ids their meaning.
        reward: the reward source, as an online module's ``reward`` (``class_path`` and ``init_args``), e.g.
            ``{class_path: rlhf_lightning.AdapterReward, init_args: {path: outputs/reward/adapters/reward}}``.
        host: the address to listen on: 127.0.0.1 (this machine only). Another address (``0.0.0.0``: every
            interface) lets anyone who reaches the port use the server, unless a token is set (a warning says so).
        port: the port to listen on; 0 = a free one (the ready line names it).
        max_batch_size: the most rows scored in one forward pass; concurrent requests are joined up to it.
        max_wait_ms: how long a request waits for others to join its batch, in milliseconds.
        device: where to score: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda``, ``cuda:1``...
        max_rows: the most completions one request may carry (a 422 beyond); RemoteReward sends its batch_size.
        max_body_mb: the most MiB one request's body may have (a 413 beyond, before it is read whole).
        max_pending: the most requests in the server at once; beyond, a 503 that clients retry.
        token_variable: the environment variable holding a bearer token; when it is set, every request must carry
            ``Authorization: Bearer <token>`` (a 401 without), and RemoteReward sends its own environment's.
        docs: serve FastAPI's ``/docs``, ``/redoc`` and ``/openapi.json`` (off: they describe the server to anyone).
    """
    checks.at_least("max_batch_size", max_batch_size)
    checks.non_negative("max_wait_ms", max_wait_ms)
    checks.in_range("port", port, 0, 65535)
    checks.at_least("max_rows", max_rows)
    checks.positive("max_body_mb", max_body_mb)
    checks.at_least("max_pending", max_pending)
    require_serving()
    limits = Limits(max_rows, int(max_body_mb * 2**20), max_pending, token_from(token_variable))
    if limits.token is None and not is_loopback(host):
        print(f"warning: serve-reward listens on {host} with no token: anyone who reaches port {port} can use it "
              f"(set ${token_variable} on the server and its clients to require one)", file=sys.stderr, flush=True)
    listening = listen(host, port)  # before minutes of loading: a port in use fails now
    with listening:
        service = load_service(base, reward, torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                                                          else "cpu" if device == "auto" else device))
        run_server(service, listening, max_batch_size, max_wait_ms / 1000, limits, docs, token_variable)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (uvicorn listens on it); one line when it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server takes its port back at once
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"serve-reward cannot listen on {host}:{port} ({error.strerror or error}): choose another "
                      "--port (0 = a free one) or --host") from None
    return sock


def load_service(spec: BaseModelSpec, source: RewardSource, device: torch.device) -> RewardService:
    """The base and the source, loaded once with the package's loading code (the same as a training run's) and
    frozen on ``device``."""
    tokenizer = load_tokenizer(spec)
    base = SharedBase(load_causal_lm(spec, tokenizer), fused_lora=spec.fused_lora)
    source.setup(base, tokenizer)
    base.requires_grad_(False).eval().to(device)
    limit, _, learned = position_limit(spec, tokenizer)
    return RewardService(source, base, tokenizer, device, base.hf_model.get_input_embeddings().num_embeddings,
                         limit if learned else None)


def run_server(service: RewardService, listening: socket.socket, max_batch_size: int, max_wait: float,
               limits: Limits = DEFAULT_LIMITS, docs: bool = False, token_variable: str = TOKEN_VARIABLE) -> None:
    """uvicorn serving ``service`` on the bound socket ``listening`` until a signal; one line when ready (the
    address, and whether a token is needed), one when stopped."""
    import uvicorn

    from rlhf_lightning.serving.app import make_app

    class Server(uvicorn.Server):
        stopped_by = "shutdown"

        async def startup(self, sockets: list | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                bound_host, bound_port = self.servers[0].sockets[0].getsockname()[:2]
                bound_host = f"[{bound_host}]" if ":" in bound_host else bound_host  # an IPv6 address in a URL
                needs = f" (bearer token: ${token_variable})" if limits.token is not None else ""
                print(f"serving {service.label} at http://{bound_host}:{bound_port}{needs}", flush=True)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.stopped_by = signal.Signals(sig).name
            super().handle_exit(sig, frame)
            # uvicorn raises the signal again after its shutdown (status 130 or 143); stopping is this server's
            # normal end: status 0.
            getattr(self, "_captured_signals", []).clear()

    app = make_app(service, max_batch_size, max_wait, limits, docs)
    server = Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.run(sockets=[listening])
    if not server.started:  # uvicorn logged why
        sys.exit(1)
    served = service.served
    print(f"stopped serving {service.label} ({server.stopped_by}; served {served['rows']} rows of "
          f"{served['requests']} requests in {served['batches']} batches)", flush=True)


def base_shorthand(args: list[str]) -> list[str]:
    """``--base PATH`` (a model folder or hub id) as ``--base.name_or_path PATH``; ``--base`` given a YAML file or
    a mapping (``{name_or_path: ..., dtype: bfloat16}``) stays what jsonargparse reads it as."""
    for index, argument in enumerate(args):
        name, equals, value = argument.partition("=")
        if name != "--base":
            continue
        value = value if equals else (args[index + 1] if index + 1 < len(args) else "")
        if value and not value.lstrip().startswith("{") and not Path(value).is_file():
            return [*args[:index], f"--base.name_or_path={value}", *args[index + (1 if equals else 2):]]
    return args


def main(args: Sequence[str], parser_class: type[ArgumentParser] = ArgumentParser) -> None:
    """``serve-reward [--config FILE] --base ... --reward ...``, parsed by ``parser_class`` (the command line's
    one-line-error parser, which it passes: importing it here would make the two modules import each other)."""
    parser = parser_class(prog="python -m rlhf_lightning serve-reward",
                          description=serve_reward.__doc__.split("\n\n")[0])
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file of these arguments")
    parser.add_function_arguments(serve_reward, as_group=False)
    config = parser.parse_args(base_shorthand(list(args)))
    init: dict[str, Any] = parser.instantiate_classes(config)
    init.pop("config", None)
    serve_reward(**init)
